/*
 * console.js - the console's behaviour. It reads and changes the server
 * only through the HTTP API a client has: GET /info, /v1/models and
 * /metrics, the admin routes under /admin/ and POST /v1/chat/completions,
 * with the admin token (and API key) typed into the page. The secrets
 * stay in this tab (sessionStorage): never in a cookie, a URL or the
 * browser's lasting storage, and the admin token goes only to /admin/ routes, the API
 * key only to the others, as the server keeps the two apart.
 *
 * The merge reports a merge answers with (per module delta_retained and
 * relative_error) are kept in memory for the tab's life: the API gives
 * the per-module figures only in the merge's answer; /admin/adapters
 * keeps the overall ones.
 */
'use strict';

const $ = (id) => document.getElementById(id);
const SVG = 'http://www.w3.org/2000/svg';
const params = new URLSearchParams(location.search);
/* how often /metrics and the admin state are read; ?poll=MS (250 at
 * least) for a faster page, as the browser test asks */
const POLL_MS = Math.max(250, Number(params.get('poll')) || 2000);
const KEEP_SAMPLES = 90; /* three minutes at the default poll */

const state = {
  info: null, admin: null, engine: null, adapters: [], models: [], pristineDigest: null,
  reports: new Map(), samples: [], chats: [], drawn: {},
};

/* Whether what part shows changed since it was last drawn: the poll
 * redraws only then, so keyboard focus on a button survives a poll. */
function changed(part, value) {
  const text = JSON.stringify(value);
  if (state.drawn[part] === text) return false;
  state.drawn[part] = text;
  return true;
}

/* --- the secrets and the requests -------------------------------------------- */

function secret(name) { return sessionStorage.getItem('qlserve.' + name) || ''; }

function setSecret(name, value) {
  if (value) sessionStorage.setItem('qlserve.' + name, value);
  else sessionStorage.removeItem('qlserve.' + name);
}

/* One request: {status, ok, text, json} (json null when the body is not
 * JSON). The admin token goes to /admin/ only, the API key elsewhere. */
async function api(method, path, body) {
  const headers = {};
  const key = path.startsWith('/admin/') ? secret('token') : secret('apikey');
  if (key) headers.Authorization = 'Bearer ' + key;
  const init = { method, headers, cache: 'no-store' };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let r;
  try {
    r = await fetch(path, init);
  } catch (e) {
    return { status: 0, ok: false, text: 'no answer: ' + e.message, json: null };
  }
  const text = await r.text();
  let json = null;
  try { json = JSON.parse(text); } catch (e) { /* not JSON: shown as text */ }
  return { status: r.status, ok: r.ok, text, json };
}

/* The message of an error answer, as the server wrote it. */
function errorText(r) {
  const m = r.json && r.json.error && (r.json.error.message || r.json.error);
  return `${r.status || 'no answer'}: ${typeof m === 'string' ? m : r.text}`;
}

/* --- small DOM helpers -------------------------------------------------------- */

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k);
  return e;
}

function svg(tag, attrs, ...kids) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
}

function fill(dl, rows) {
  dl.replaceChildren();
  for (const [k, v] of rows) {
    if (v === undefined || v === null) continue;
    dl.append(el('dt', {}, k), el('dd', {}, String(v)));
  }
}

function bytes(n) {
  if (typeof n !== 'number') return '?';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fixed(x, d) { return typeof x === 'number' ? x.toFixed(d) : '?'; }

/* --- the model, the weights, the adapters ------------------------------------- */

function renderAuth(r) {
  const s = $('auth-state');
  if (r.ok) {
    s.textContent = secret('token') ? 'Admin API: the token was accepted.'
      : 'Admin API: open to this loopback client (no admin token in force).';
    s.className = 'good';
  } else if (r.status === 401) {
    s.textContent = `The admin token was refused (${errorText(r)}). `
      + 'Type the token from --admin-token-file, or the one the server logged at start.';
    s.className = 'bad';
  } else {
    s.textContent = `The admin API refused this page (${errorText(r)}).`;
    s.className = 'bad';
  }
  document.body.dataset.auth = r.ok ? 'ok' : String(r.status);
}

function renderModel() {
  const i = state.info, e = state.engine;
  if (!i) return;
  $('model-id').textContent = i.model_id;
  fill($('model-info'), [
    ['architecture', i.architecture], ['format', i.format], ['quant kinds', i.quant],
    ['weight bytes', i.weight_bytes !== undefined ? `${bytes(i.weight_bytes)} (${i.weight_bytes})` : null],
    ['backend', i.device], ['CPU kernels', i.cpu_kernels], ['8-bit kernels', i.q8_kernels],
    ['f32 kernels', i.f32_kernels], ['activations', i.activations], ['KV dtype', i.kv_dtype],
    ['KV blocks', i.kv_blocks_total], ['context', i.max_total_tokens],
    ['qlserve', i.version],
    ['engine', e ? `${e.running} running, ${e.waiting} waiting, ${e.steps} steps`
      + `${e.paused ? `, paused (${e.steps_left} steps left)` : ''}` : null],
  ]);
}

function renderWeights() {
  const a = state.admin || state.info;
  if (!a || !a.weights_digest) return;
  const merged = a.merged || [];
  /* the README's rule: any version with nothing merged is the pristine weights */
  if (!merged.length && !state.pristineDigest) state.pristineDigest = a.weights_digest;
  const mark = $('weights-mark');
  mark.textContent = merged.length ? 'merged' : 'pristine';
  mark.className = 'mark ' + (merged.length ? 'merged' : 'pristine');
  $('weights-version').textContent = a.weights_version;
  $('weights-digest').textContent = a.weights_digest;
  $('weights-merged').textContent = merged.length
    ? 'Merged: ' + merged.map((m) => `${m.name} × ${m.scale}`).join(', ')
    : 'Nothing is merged: these are the weights the model file holds.';
  $('weights-pristine-digest').textContent = state.pristineDigest && merged.length
    ? `The pristine digest was ${state.pristineDigest}.` : '';
  if (!state.admin) return;
  const s = state.admin;
  fill($('weights-state'), [
    ['adapters loaded', s.adapters_loaded], ['adapter bytes', bytes(s.adapter_bytes)],
    ['merges', s.merges], ['unmerges', s.unmerges],
    ['state file', s.state_file || 'none'], ['state file error', s.state_file_error],
    ['restore errors', (s.restore_errors || []).length
      ? s.restore_errors.map((e) => `${e.name || e.path}: ${e.error}`).join('; ') : null],
  ]);
}

function actionButton(label, name, handler, disabled) {
  const b = el('button', { type: 'button', 'aria-label': `${label} ${name}`,
    'data-action': label.toLowerCase(), 'data-adapter': name, onclick: handler }, label);
  if (label === 'Unload') b.classList.add('danger');
  b.disabled = !!disabled;
  return b;
}

function renderAdapters() {
  if (!changed('adapters', state.adapters)) return;
  if (state.reports.size) renderCosts();
  const body = $('adapter-table').querySelector('tbody');
  body.replaceChildren();
  for (const a of state.adapters) {
    const lm = a.last_merge;
    /* data-label: a narrow screen shows each cell under its column's name */
    const cell = (label, ...kids) => el('td', { 'data-label': label }, ...kids);
    body.append(el('tr', { 'data-adapter': a.name },
      el('th', { scope: 'row' }, a.name),
      cell('rank / alpha', `${a.rank} / ${a.alpha}${a.use_rslora ? ' (rsLoRA)' : ''}`),
      cell('scale', String(a.scale)),
      cell('bytes', bytes(a.bytes)),
      cell('merged', a.merged ? `yes × ${a.merged_scale}` : 'no'),
      cell('requests', String(a.requests)),
      cell('last use', a.last_used ? new Date(a.last_used * 1000).toLocaleString() : '—'),
      cell('last merge', lm ? `kept ${fixed(lm.delta_retained, 3)}, error ${fixed(lm.relative_error, 3)}, ${fixed(lm.seconds, 2)} s` : '—'),
      cell('actions', el('div', { class: 'row' },
        actionButton('Merge', a.name, () => merge(a.name)),
        actionButton('Unmerge', a.name, () => unmerge(a.name), !a.merged),
        actionButton('Unload', a.name, () => unload(a.name))))));
  }
  $('adapters-none').hidden = state.adapters.length > 0;
}

function renderModels() {
  const ids = state.models.map((m) => m.id);
  if (state.info && !ids.includes(state.info.model_id)) ids.unshift(state.info.model_id);
  if (!changed('models', ids)) return;
  for (const k of [0, 1]) {
    const sel = $('chat-model-' + k);
    const had = sel.value;
    sel.replaceChildren(...ids.map((id) => el('option', { value: id }, id)));
    /* the base on the left, the first adapter on the right, until chosen */
    const adapter = ids.find((id) => state.info && id !== state.info.model_id);
    const fallback = k === 1 && adapter ? adapter : ids[0] || '';
    sel.value = sel.dataset.chosen && ids.includes(had) ? had : fallback;
  }
}

/* Read everything but /metrics once more and redraw. */
async function refresh() {
  const [info, admin, list, models, engine] = await Promise.all([
    api('GET', '/info'), api('GET', '/admin/state'), api('GET', '/admin/adapters'),
    api('GET', '/v1/models'), api('GET', '/admin/engine'),
  ]);
  if (info.ok) state.info = info.json;
  state.engine = engine.ok ? engine.json : null;
  renderAuth(admin);
  state.admin = admin.ok ? admin.json : null;
  if (list.ok) state.adapters = list.json.adapters || [];
  if (models.ok) state.models = models.json.data || [];
  renderModel();
  renderWeights();
  renderAdapters();
  renderModels();
  if (!info.ok || !models.ok)
    $('traffic-note').textContent = `(/info or /v1/models: ${errorText(info.ok ? models : info)})`;
}

/* --- the actions: confirmed, answered as the API answered ----------------------- */

function confirmAction(text) {
  const d = $('confirm');
  $('confirm-text').textContent = text;
  d.returnValue = '';
  d.showModal();
  return new Promise((resolve) => {
    d.addEventListener('close', () => resolve(d.returnValue === 'yes'), { once: true });
  });
}

function showResult(method, path, r) {
  const out = $('action-result');
  const body = r.json ? JSON.stringify(r.json, null, 2) : r.text;
  out.textContent = `${method} ${path} → ${r.status || 'no answer'}\n${body}`;
  out.className = r.ok ? '' : 'error';
  out.dataset.status = String(r.status);
}

async function act(question, method, path, body) {
  if (!(await confirmAction(question))) {
    $('action-result').textContent = 'Cancelled: ' + question;
    return null;
  }
  const r = await api(method, path, body);
  showResult(method, path, r);
  await refresh();
  return r;
}

async function load(ev) {
  ev.preventDefault();
  const name = $('load-name').value.trim(), path = $('load-path').value.trim();
  const body = { name, path };
  const scale = Number($('load-scale').value);
  if ($('load-scale').value !== '' && scale !== 1) body.scale = scale;
  await act(`Load ${path} as adapter ${name}${body.scale !== undefined ? ` at scale ${scale}` : ''}?`,
    'POST', '/admin/adapters', body);
}

async function merge(name) {
  const body = { safe_merge: $('merge-safe').checked };
  if ($('merge-scale').value !== '') body.scale = Number($('merge-scale').value);
  if ($('merge-into').value) body.into = $('merge-into').value;
  const r = await act(`Merge ${name} into the served weights (scale ${body.scale ?? "the adapter's"}, `
    + `into ${body.into || "the weight's own kind"}, safe merge ${body.safe_merge ? 'on' : 'off'})? `
    + 'Requests keep being answered meanwhile.', 'POST', `/admin/adapters/${encodeURIComponent(name)}/merge`, body);
  if (r && r.ok) {
    state.reports.delete(name);
    state.reports.set(name, { ...r.json, into: body.into || null });
    renderCosts();
  }
}

async function unmerge(name) {
  await act(`Unmerge ${name}? The weights go back to what the rest merged over the pristine ones.`,
    'POST', `/admin/adapters/${encodeURIComponent(name)}/unmerge`, {});
}

async function unload(name) {
  const r = await act(`Unload ${name}? Requests that name it will be refused (or load it again on `
    + 'first use where the server loads adapters by name).', 'DELETE',
  `/admin/adapters/${encodeURIComponent(name)}`);
  if (r && r.ok) { state.reports.delete(name); renderCosts(); }
}

/* --- merge costs: a chart per report, drawn by hand ------------------------------ */

/* Bars, one per module, of values in [0, top]; a line at ref (null:
 * none). Each bar's title names its module and value. */
function barChart(label, modules, key, top, ref, cls) {
  const W = 640, H = 130, L = 40, T = 8, B = 18;
  const w = (W - L) / Math.max(1, modules.length);
  const y = (v) => T + (H - T - B) * (1 - Math.min(v, top) / top);
  const g = svg('svg', { viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': label,
    class: 'cost ' + key });
  g.append(svg('line', { x1: L, x2: W, y1: y(0), y2: y(0), stroke: 'currentColor', 'stroke-opacity': 0.4 }));
  g.append(svg('text', { x: L - 4, y: y(top) + 8, 'text-anchor': 'end' }, fixed(top, top < 10 ? 2 : 0)));
  g.append(svg('text', { x: L - 4, y: y(0), 'text-anchor': 'end' }, '0'));
  modules.forEach((m, i) => {
    const v = m[key];
    const r = svg('rect', { x: L + i * w + w * 0.1, width: Math.max(0.5, w * 0.8), y: y(v),
      height: Math.max(0.5, y(0) - y(v)), fill: 'currentColor', class: cls });
    r.append(svg('title', {}, `${m.module} (${m.kind}): ${key} ${fixed(v, 4)}`));
    g.append(r);
  });
  if (ref !== null)
    g.append(svg('line', { x1: L, x2: W, y1: y(ref), y2: y(ref), stroke: 'currentColor',
      'stroke-dasharray': '4 3' }));
  g.append(svg('text', { x: L, y: H - 4 }, `${modules.length} modules, layer order`));
  return g;
}

function costBlock(name, r) {
  const mods = r.modules || [];
  const topErr = Math.max(1, ...mods.map((m) => m.relative_error));
  const table = el('table', {}, el('thead', {}, el('tr', {}, el('th', {}, 'module'),
    el('th', {}, 'kind'), el('th', {}, 'delta_retained'), el('th', {}, 'relative_error'))));
  const tb = el('tbody');
  for (const m of mods)
    tb.append(el('tr', {}, el('td', {}, m.module), el('td', {}, m.kind),
      el('td', {}, fixed(m.delta_retained, 4)), el('td', {}, fixed(m.relative_error, 4))));
  table.append(tb);
  const now = state.adapters.find((a) => a.name === name);
  const since = now && !now.merged ? ' (unmerged since)' : '';
  return el('div', { class: 'chart-block', 'data-adapter': name },
    el('h3', {}, `${name}: merged at version ${r.version}${since} in ${fixed(r.seconds, 2)} s`
      + `${r.into ? `, into ${r.into}` : ''}; overall kept ${fixed(r.delta_retained, 3)}, `
      + `relative error ${fixed(r.relative_error, 3)}`),
    el('p', { class: 'legend' }, el('span', { class: 'sw1' }, '■ delta_retained (1 = all kept, dashed)'),
      el('span', { class: 'sw2' }, '■ relative_error')),
    el('div', { class: 'sw1' }, barChart(`${name}: delta_retained per module`, mods, 'delta_retained', 1, 1, 'sw1')),
    el('div', { class: 'sw2' }, barChart(`${name}: relative_error per module`, mods, 'relative_error', topErr, null, 'sw2')),
    el('details', {}, el('summary', {}, 'The figures as a table'), el('div', { class: 'scroll' }, table)));
}

/* The reports, the newest merge first (a merge moves its adapter's report
 * to the end of the Map). */
function renderCosts() {
  const box = $('cost-chart');
  const names = [...state.reports.keys()].reverse();
  if (!names.length) {
    box.replaceChildren(el('p', { class: 'muted' }, 'Merge an adapter to see its report per module.'));
    $('cost-advice').hidden = true;
    return;
  }
  box.replaceChildren(...names.map((n) => costBlock(n, state.reports.get(n))));
  const r = state.reports.get(names[0]);
  const low = typeof r.delta_retained === 'number' && r.delta_retained < 0.5;
  $('cost-advice').hidden = !low;
  if (low)
    $('cost-advice').textContent = `${names[0]}'s merge kept ${fixed(r.delta_retained * 100, 0)}% of `
      + 'its delta: the quantizer rounded the rest away. Serve it unmerged, or merge it again '
      + 'with into int8 or bf16.';
}

/* --- live traffic from /metrics -------------------------------------------------- */

/* Prometheus text into a Map of 'name{labels}' (labels as written) and
 * plain 'name' to numbers. */
function parseMetrics(text) {
  const m = new Map();
  for (const line of text.split('\n')) {
    if (!line || line[0] === '#') continue;
    const at = line.lastIndexOf(' ');
    m.set(line.slice(0, at), Number(line.slice(at + 1)));
  }
  return m;
}

function labelled(m, name, label) {
  const out = new Map();
  const re = new RegExp(`^${name.replace(/[:]/g, '\\$&')}\\{.*${label}="((?:[^"\\\\]|\\\\.)*)"`);
  for (const [k, v] of m) {
    const hit = re.exec(k);
    if (hit) out.set(hit[1], v);
  }
  return out;
}

function rate(a, b, name) {
  if (!a || !b || !a.m.has(name) || !b.m.has(name)) return null;
  return Math.max(0, b.m.get(name) - a.m.get(name)) / ((b.t - a.t) / 1000);
}

/* The q quantile of a histogram's observations between samples a and b
 * (cumulative buckets, linear within one), in ms; null with none. */
function quantile(a, b, name, q) {
  if (!a || !b) return null;
  const les = [];
  for (const [k, v] of b.m) {
    const hit = k.startsWith(name + '_bucket{') && /le="([^"]+)"/.exec(k);
    if (hit) les.push([hit[1] === '+Inf' ? Infinity : Number(hit[1]), v - (a.m.get(k) || 0)]);
  }
  les.sort((x, y) => x[0] - y[0]);
  const total = les.length ? les[les.length - 1][1] : 0;
  if (!total) return null;
  let prevLe = 0, prevN = 0;
  for (const [le, n] of les) {
    if (n >= q * total) {
      if (le === Infinity) return prevLe * 1000;
      return 1000 * (prevLe + (le - prevLe) * ((q * total - prevN) / Math.max(1e-9, n - prevN)));
    }
    prevLe = le; prevN = n;
  }
  return null;
}

/* The figures one sample adds to each plot: its rates against the
 * previous sample, its percentiles over the last WINDOW samples. */
const WINDOW = 5;
function figures(i) {
  const s = state.samples, b = s[i], a = s[i - 1], w = s[Math.max(0, i - WINDOW)];
  const g = (n) => (b.m.has(n) ? b.m.get(n) : null);
  const kvTotal = g('qlserve_kv_blocks_total');
  const dq = a ? g('qlserve_prefix_cache_queries_total') - a.m.get('qlserve_prefix_cache_queries_total') : 0;
  const dh = a ? g('qlserve_prefix_cache_hits_total') - a.m.get('qlserve_prefix_cache_hits_total') : 0;
  const perAdapter = {};
  for (const name of labelled(b.m, 'qlserve_adapter_requests_total', 'adapter').keys())
    perAdapter[name] = rate(a, b, `qlserve_adapter_requests_total{adapter="${name}"}`);
  return {
    requests: { all: rate(a, b, 'qlserve_requests_total'), ...perAdapter },
    tokens: { generated: rate(a, b, 'qlserve_generated_tokens_total'),
      prompt: rate(a, b, 'qlserve_prompt_tokens_total') },
    queue: { waiting: g('qlserve_queue_depth'), running: g('vllm:num_requests_running') },
    kv: { used: kvTotal ? (100 * g('qlserve_kv_blocks_used')) / kvTotal : null },
    prefix: { 'hit %': dq > 0 ? (100 * dh) / dq : null },
    ttft: { p50: quantile(w, b, 'qlserve_time_to_first_token_seconds', 0.5),
      p95: quantile(w, b, 'qlserve_time_to_first_token_seconds', 0.95) },
    itl: { p50: quantile(w, b, 'qlserve_time_per_output_token_seconds', 0.5),
      p95: quantile(w, b, 'qlserve_time_per_output_token_seconds', 0.95) },
  };
}

const PLOTS = [
  ['requests', 'Requests per second, all and per adapter', ''],
  ['tokens', 'Tokens per second', ''],
  ['queue', 'Requests waiting and running', ''],
  ['kv', 'KV cache in use', '%'],
  ['prefix', 'Prefix cache hits (prompt tokens)', '%'],
  ['ttft', 'Time to first token', ' ms'],
  ['itl', 'Time between tokens', ' ms'],
];

function linePlot(key, title, unit, rows) {
  const names = [];
  for (const r of rows) for (const n of Object.keys(r)) if (!names.includes(n)) names.push(n);
  const W = 300, H = 90, T = 6, B = 6;
  let top = 0;
  for (const r of rows) for (const n of names) if (r[n] !== null && r[n] !== undefined) top = Math.max(top, r[n]);
  top = key === 'kv' || key === 'prefix' ? 100 : top > 0 ? top * 1.1 : 1;
  const x = (i) => (W * i) / Math.max(1, KEEP_SAMPLES - 1);
  const y = (v) => T + (H - T - B) * (1 - v / top);
  const g = svg('svg', { viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': title });
  g.append(svg('line', { x1: 0, x2: W, y1: y(0), y2: y(0), stroke: 'currentColor', 'stroke-opacity': 0.3 }));
  g.append(svg('text', { x: 2, y: T + 9 }, `${fixed(top, top < 10 ? 2 : 0)}${unit}`));
  const last = rows[rows.length - 1] || {};
  const legend = el('p', { class: 'legend now' });
  names.slice(0, 4).forEach((n, k) => {
    let d = '';
    const off = KEEP_SAMPLES - rows.length;
    rows.forEach((r, i) => {
      const v = r[n];
      if (v === null || v === undefined) { d += ' '; return; }
      d += `${d === '' || d.endsWith(' ') ? 'M' : 'L'}${x(off + i).toFixed(1)},${y(v).toFixed(1)}`;
    });
    const path = d.trim();
    if (path) g.append(svg('path', { d: path.replace(/ +/g, ' '), fill: 'none', stroke: 'currentColor',
      'stroke-width': 1.5, class: 'sw' + (k + 1), 'data-series': n }));
    /* the newest figure as a dot: a series with one figure has no line */
    const at = rows.map((r) => r[n]).findLastIndex((v) => v !== null && v !== undefined);
    if (at >= 0) g.append(svg('circle', { cx: x(off + at), cy: y(rows[at][n]), r: 2.5,
      fill: 'currentColor', class: 'sw' + (k + 1) }));
    const v = last[n];
    legend.append(el('span', { class: 'sw' + (k + 1), 'data-series': n },
      `■ ${n} ${v === null || v === undefined ? '–' : fixed(v, v < 10 ? 2 : 0) + unit}`));
  });
  return el('div', { class: 'plot', id: 'plot-' + key }, el('h3', {}, title), legend, g);
}

function renderTraffic() {
  const s = state.samples;
  const rows = {};
  for (const [key] of PLOTS) rows[key] = [];
  for (let i = 0; i < s.length; i++) {
    const f = figures(i);
    for (const [key] of PLOTS) rows[key].push(f[key]);
  }
  $('plots').replaceChildren(...PLOTS.map(([key, title, unit]) => linePlot(key, title, unit, rows[key])));
  $('plots').dataset.samples = String(s.length);
}

async function poll() {
  try {
    const r = await api('GET', '/metrics');
    if (r.ok) {
      state.samples.push({ t: performance.now(), m: parseMetrics(r.text) });
      if (state.samples.length > KEEP_SAMPLES) state.samples.shift();
      $('traffic-note').textContent = `(/metrics every ${POLL_MS / 1000} s)`;
      renderTraffic();
    } else {
      $('traffic-note').textContent = `(/metrics: ${errorText(r)})`;
    }
    await refresh();
  } finally {
    /* an answer of a shape this page did not expect stops nothing */
    setTimeout(poll, POLL_MS);
  }
}

/* --- chat: two streams side by side --------------------------------------------- */

async function stream(k, prompt, signal) {
  const answer = $('answer-' + k), finish = $('finish-' + k), model = $('chat-model-' + k).value;
  answer.textContent = '';
  finish.textContent = `asking ${model}…`;
  $('pane-' + k).dataset.state = 'running';
  const headers = { 'Content-Type': 'application/json' };
  if (secret('apikey')) headers.Authorization = 'Bearer ' + secret('apikey');
  const body = { model, stream: true, messages: [{ role: 'user', content: prompt }],
    max_tokens: Number($('chat-max').value) || 32, temperature: Number($('chat-temp').value) || 0 };
  let why = null, chunks = 0;
  try {
    const r = await fetch('/v1/chat/completions', { method: 'POST', headers, body: JSON.stringify(body), signal });
    if (!r.ok) {
      const text = await r.text();
      let json = null;
      try { json = JSON.parse(text); } catch (e) { /* shown as text */ }
      throw new Error(errorText({ status: r.status, text, json }));
    }
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let end;
      while ((end = buf.indexOf('\n\n')) >= 0) {
        const ev = buf.slice(0, end);
        buf = buf.slice(end + 2);
        for (const line of ev.split('\n')) {
          if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
          const j = JSON.parse(line.slice(6));
          if (j.error) throw new Error(j.error.message || JSON.stringify(j.error));
          const c = j.choices && j.choices[0];
          if (c && c.delta && c.delta.content) { answer.textContent += c.delta.content; chunks++; }
          if (c && c.finish_reason) why = c.finish_reason;
        }
      }
    }
    finish.textContent = `${model}: ${chunks} chunks, finish_reason ${why}`;
    $('pane-' + k).dataset.state = 'done';
  } catch (e) {
    finish.textContent = `${model}: ${e.name === 'AbortError' ? 'stopped' : e.message}`;
    $('pane-' + k).dataset.state = 'error';
  }
}

function chat(ev) {
  ev.preventDefault();
  for (const c of state.chats) c.abort();
  const prompt = $('chat-prompt').value;
  state.chats = [0, 1].map(() => new AbortController());
  Promise.all([0, 1].map((k) => stream(k, prompt, state.chats[k].signal))).then(refresh);
}

/* --- start ----------------------------------------------------------------------- */

$('auth').addEventListener('submit', (ev) => {
  ev.preventDefault();
  setSecret('token', $('token').value);
  setSecret('apikey', $('apikey').value);
  refresh();
});
$('auth-forget').addEventListener('click', () => {
  setSecret('token', ''); setSecret('apikey', '');
  $('token').value = ''; $('apikey').value = '';
  refresh();
});
$('load-form').addEventListener('submit', load);
$('merge-form').addEventListener('submit', (ev) => ev.preventDefault());
$('chat-form').addEventListener('submit', chat);
for (const k of [0, 1])
  $('chat-model-' + k).addEventListener('change', (ev) => { ev.target.dataset.chosen = '1'; });
$('chat-stop').addEventListener('click', () => state.chats.forEach((c) => c.abort()));
$('token').value = secret('token');
$('apikey').value = secret('apikey');
poll();
