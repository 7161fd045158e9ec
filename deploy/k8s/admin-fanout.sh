#!/usr/bin/env bash
# admin-fanout.sh - send one admin call to every running qlserve replica.
#
# Each replica holds its own adapter registry and its own merged weights, so
# an admin call made through the Service reaches one pod at random. This
# sends it to each pod in turn instead: `kubectl exec` into the pod, then an
# HTTP/1.0 request to the server on the pod's loopback, with the pod's own
# QLSERVE_ADMIN_TOKEN as the bearer token. So the token never leaves the
# cluster and needs no port-forward; what it needs is RBAC for `pods/exec`,
# and bash in the image (both images have it; neither has curl).
#
#   deploy/k8s/admin-fanout.sh METHOD PATH [JSON_BODY]
#
#   deploy/k8s/admin-fanout.sh POST /admin/adapters '{"name": "sql", "path": "sql", "scale": 1.0}'
#   deploy/k8s/admin-fanout.sh POST /admin/adapters/sql/merge '{"scale": 1.0, "into": "int8"}'
#   deploy/k8s/admin-fanout.sh GET /admin/state
#   deploy/k8s/admin-fanout.sh DELETE /admin/adapters/sql
#
# Environment: NAMESPACE (default: kubectl's current one), SELECTOR (the
# pods' labels, default app=qlserve as in deployment.yaml), CONTAINER
# (default qlserve), PORT (the server's port in the pod, default 8080).
#
# Prints each pod's status line and body. Exit status: 0 when every pod
# answered 2xx, 1 when any did not (the others still got the call: re-run
# it for the ones that failed; a POST of an adapter already loaded answers
# 409 there and changes nothing). A replica that starts later (scale-up,
# restart, rollout) loads adapters of the shared folder by name as requests
# name them, but not scales or merges: run those calls again.
set -euo pipefail

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
fi
method=$1 path=$2 body=${3:-}
case $path in
  /admin/*) ;;
  *) echo "admin-fanout: $path is not an admin route (/admin/...)" >&2; exit 2 ;;
esac

selector=${SELECTOR:-app=qlserve}
container=${CONTAINER:-qlserve}
port=${PORT:-8080}
kc=(kubectl)
[ -n "${NAMESPACE:-}" ] && kc+=(--namespace "$NAMESPACE")

# Runs inside the pod: $1 method, $2 path, $3 port; the body on stdin.
# LC_ALL=C so that ${#body} counts bytes, as Content-Length must. (Single
# quotes: it expands in the pod, not here.)
# shellcheck disable=SC2016
remote='
set -eu
LC_ALL=C
body=$(cat)
exec 3<>"/dev/tcp/127.0.0.1/$3"
{
  printf "%s %s HTTP/1.0\r\nHost: localhost\r\n" "$1" "$2"
  if [ -n "${QLSERVE_ADMIN_TOKEN:-}" ]; then
    printf "Authorization: Bearer %s\r\n" "$QLSERVE_ADMIN_TOKEN"
  fi
  printf "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" "${#body}" "$body"
} >&3
cat <&3'

pods=$("${kc[@]}" get pods -l "$selector" --field-selector=status.phase=Running \
  -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')
if [ -z "$pods" ]; then
  echo "admin-fanout: no running pods match $selector" >&2
  exit 1
fi

ok=0 failed=0
for pod in $pods; do
  if response=$(printf '%s' "$body" |
    "${kc[@]}" exec -i "$pod" -c "$container" -- bash -c "$remote" fanout "$method" "$path" "$port"); then
    status=$(printf '%s\n' "$response" | head -n 1 | tr -d '\r')
  else
    status="kubectl exec failed"
  fi
  # the body: what follows the blank line after the headers
  answer=$(printf '%s\n' "$response" | tr -d '\r' | sed '1,/^$/d')
  echo "== $pod: $status"
  [ -n "$answer" ] && echo "$answer"
  case $status in
    "HTTP/1."?" 2"[0-9][0-9]*) ok=$((ok + 1)) ;;
    *) failed=$((failed + 1)) ;;
  esac
done
echo "admin-fanout: $method $path: $ok replicas answered 2xx, $failed did not"
[ "$failed" -eq 0 ]
