"""clients.py - every call of issue 14's OpenAI and TGI surfaces made with
the real clients (the `openai` SDK, huggingface_hub's InferenceClient)
against a running qlserve (tests/conformance/run.sh starts it on the tiny
random model with SmolLM2's chat template).

Each check is one call (or a few that pin one feature against another)
with plain asserts on the shape and on sense: text where text is due,
usage counts against the server's own tokenizer (POST /tokenize,
/chat_tokenize), finish reasons, greedy answers equal across routes and
clients, a banned token absent, a penalty that stops repeats, a seed that
repeats a sample, logprobs equal across routes; and issue 19's constrained
answers: a json_schema response_format and tool calls (tool_choice
"required", a named function, streamed) through the openai SDK, TGI's
grammar and Messages-API response_format through InferenceClient, whose
JSON the `jsonschema` package validates against the schemas sent; and
issue 35's Anthropic Messages API through the official `anthropic` SDK
(messages.create, messages.stream, a forced tool's tool_use then a
tool_result turn, count_tokens, stop sequences, a refused block, a wrong
key), each compared with chat completions' answer to the same
conversation; and the Responses API through the openai SDK
(responses.create, responses.stream and its event helpers, function tools
with a function_call_output second turn, text.format json_schema and
json_object, previous_response_id with retrieve and delete, refusals);
and reasoning kept apart, on a third server with Qwen3's chat template
(--thinking), its answer forced by vLLM's guided_regex: the openai SDK's
chat reasoning_content (whole and streamed) and Responses reasoning items
(whole, and through responses.stream's helpers), and the anthropic SDK's
thinking blocks (messages.create with thinking enabled, messages.stream,
a second turn sending the thinking block back). The model's weights are
random (leaning to printable ASCII, see tiny_model.py), so its text is
noise, but noise that greedy decoding and seeds make deterministic: the
checks compare answers with each other, never with hard-coded text.

One line per check, PASS or FAIL with the reason, then a summary; the exit
status is 1 when any check failed.

    clients.py --base URL --keyed URL --key KEY --model NAME
"""

import argparse
import json
import math
import sys
import time
import traceback
import urllib.error
import urllib.request

import anthropic
import jsonschema
import openai
import huggingface_hub
from huggingface_hub import InferenceClient

ARGS = None
OAI = None  # openai.OpenAI on the open server
OAI_T = None  # openai.OpenAI on the thinking server (Qwen3's template)
ANT_T = None  # anthropic.Anthropic on the thinking server
ANT = None  # anthropic.Anthropic on the open server
HF = None  # InferenceClient on the open server
PROMPT = "Hello the world"
PROMPT2 = "A tiny model"
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


class Skip(Exception):
    """A check that does not apply to this client version."""


# --- raw HTTP: the server's own answers the checks compare with -------------

def raw(method, path, body=None, base=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request((base or ARGS.base) + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text.decode(errors="replace")


def token_ids(text):
    status, toks = raw("POST", "/tokenize", {"inputs": text})
    assert status == 200, "POST /tokenize: %s %s" % (status, toks)
    return [t["id"] for t in toks]


def chat_prompt_tokens(messages):
    status, j = raw("POST", "/chat_tokenize", {"model": ARGS.model, "messages": messages})
    assert status == 200, "POST /chat_tokenize: %s %s" % (status, j)
    return len(j["tokenize_response"])


def greedy(prompt, n_tokens, **extra):
    """The server's greedy completion of a prompt, through the SDK."""
    r = OAI.completions.create(model=ARGS.model, prompt=prompt, max_tokens=n_tokens,
                               temperature=0, **extra)
    return r.choices[0].text


def greedy_ids(prompt, n_tokens):
    """The greedy completion's token ids, from POST /generate's details."""
    status, j = raw("POST", "/generate", {"inputs": prompt, "parameters": {
        "max_new_tokens": n_tokens, "details": True}})
    assert status == 200, "POST /generate: %s %s" % (status, j)
    return [t["id"] for t in j["details"]["tokens"]]


def first_new_ascii(text, start=1):
    """An index k >= start where text[k] is an ASCII letter or digit not
    seen before it: a stop string whose cut is known, text[:k]."""
    for k in range(start, len(text)):
        c = text[k]
        if c.isascii() and c.isalnum() and c not in text[:k]:
            return k
    raise AssertionError("no usable stop character in the greedy text %r" % text)


# the tiny tokenizer's merged tokens ("Ġt", "he", "Ġthe") also spell t, h, e
# and space; the checks on characters leave those out
MERGE_CHARS = set("the ")
EOS = {"259": 100}  # a logit_bias forcing <|endoftext|>


def ascii_repeats(text):
    seen, rep = set(), set()
    for c in text:
        if c.isascii() and c.isprintable() and c not in MERGE_CHARS:
            (rep if c in seen else seen).add(c)
    return rep


def is_logprob(x):
    """A log probability as the tiny model gives them: finite and below 0
    (its next-token distribution is spread over about a hundred tokens, so
    no token is certain; a 0 would be a placeholder, not a logprob)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and -1e4 < x < 0.0


def usage_ok(u, prompt_tokens, completion_tokens=None):
    assert u is not None, "no usage"
    assert u.prompt_tokens == prompt_tokens, "usage.prompt_tokens %s, the tokenizer says %s" % (
        u.prompt_tokens, prompt_tokens)
    if completion_tokens is not None:
        assert u.completion_tokens == completion_tokens, "usage.completion_tokens %s, want %s" % (
            u.completion_tokens, completion_tokens)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, "usage.total_tokens %s" % (
        u.total_tokens,)


# --- OpenAI SDK: models and completions -------------------------------------

@check
def oai_models_list():
    models = OAI.models.list()
    ids = [m.id for m in models.data]
    assert ARGS.model in ids, "%r not in /v1/models %r" % (ARGS.model, ids)
    assert all(m.object == "model" for m in models.data)


@check
def oai_completion_string():
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion", r.object
    assert r.model == ARGS.model, r.model
    assert len(r.choices) == 1 and r.choices[0].index == 0
    c = r.choices[0]
    assert c.text, "empty text"
    assert c.finish_reason == "length", c.finish_reason
    usage_ok(r.usage, len(token_ids(PROMPT)), 8)
    assert greedy(PROMPT, 8) == c.text, "temperature 0 is not deterministic"


@check
def oai_completion_prompt_list():
    want = [greedy(PROMPT, 6), greedy(PROMPT2, 6)]
    r = OAI.completions.create(model=ARGS.model, prompt=[PROMPT, PROMPT2], max_tokens=6,
                               temperature=0)
    assert [c.index for c in r.choices] == [0, 1], [c.index for c in r.choices]
    assert [c.text for c in r.choices] == want, "%r != one prompt at a time %r" % (
        [c.text for c in r.choices], want)
    usage_ok(r.usage, len(token_ids(PROMPT)) + len(token_ids(PROMPT2)), 12)


@check
def oai_completion_token_ids():
    ids = token_ids(PROMPT)
    r = OAI.completions.create(model=ARGS.model, prompt=ids, max_tokens=6, temperature=0)
    assert len(r.choices) == 1
    assert r.choices[0].text == greedy(PROMPT, 6), "token ids and their text complete differently"
    usage_ok(r.usage, len(ids), 6)


@check
def oai_completion_lists_of_ids():
    a, b = token_ids(PROMPT), token_ids(PROMPT2)
    r = OAI.completions.create(model=ARGS.model, prompt=[a, b], max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1], [c.index for c in r.choices]
    assert [c.text for c in r.choices] == [greedy(PROMPT, 5), greedy(PROMPT2, 5)]
    usage_ok(r.usage, len(a) + len(b), 10)


@check
def oai_completion_n2():
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=8, n=2,
                               temperature=1, seed=11)
    assert [c.index for c in r.choices] == [0, 1], [c.index for c in r.choices]
    assert all(c.text and c.finish_reason == "length" for c in r.choices)
    assert r.choices[0].text != r.choices[1].text, "two samples of 8 near-uniform tokens agree"
    again = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=8, n=2,
                                   temperature=1, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in r.choices], "seeded n=2 differs"
    # prompt tokens counted once, as OpenAI does
    usage_ok(r.usage, len(token_ids(PROMPT)), 16)


@check
def oai_completion_prompt_list_n2():
    r = OAI.completions.create(model=ARGS.model, prompt=[PROMPT, PROMPT2], max_tokens=4, n=2,
                               temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3], [c.index for c in r.choices]
    want = [greedy(PROMPT, 4)] * 2 + [greedy(PROMPT2, 4)] * 2  # index i*n+j: prompt-major
    assert [c.text for c in r.choices] == want, "%r != %r" % ([c.text for c in r.choices], want)


@check
def oai_completion_best_of():
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=6, n=1, best_of=3,
                               temperature=1, seed=5)
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    # the usage counts every candidate's tokens
    assert r.usage.completion_tokens in (6, 18), r.usage.completion_tokens
    # the candidates are the n=3 choices of the same seed (choice i draws
    # from seed + i); the answer is the likeliest (all are 6 tokens long, so
    # by sum or per token alike)
    c3 = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=6, n=3,
                                temperature=1, seed=5, logprobs=1).choices
    scored = [(sum(c.logprobs.token_logprobs), c.text) for c in c3]
    assert r.choices[0].text == max(scored)[1], "best_of chose %r of %r" % (
        r.choices[0].text, scored)


@check
def oai_completion_echo():
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=5, echo=True,
                               temperature=0)
    t = r.choices[0].text
    assert t == PROMPT + greedy(PROMPT, 5), "echo: %r" % t


@check
def oai_completion_logprobs():
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=6, logprobs=2,
                               temperature=0)
    lp = r.choices[0].logprobs
    assert lp is not None, "logprobs is null"
    assert len(lp.tokens) == 6, "tokens %r" % lp.tokens
    assert len(lp.token_logprobs) == 6 and all(is_logprob(x) for x in lp.token_logprobs), \
        lp.token_logprobs
    assert len(lp.top_logprobs) == 6
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(top, dict) and 1 <= len(top) <= 3, top
        assert all(is_logprob(v) for v in top.values()), top
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-4, "top probabilities %r" % top
        # greedy: the chosen token is the likeliest
        assert abs(x - max(top.values())) < 1e-4, "greedy token %r at %s, top %r" % (tok, x, top)
    assert all(isinstance(o, int) for o in lp.text_offset), lp.text_offset
    assert all(a <= b for a, b in zip(lp.text_offset, lp.text_offset[1:])), lp.text_offset
    # each offset moves by its token's text (the tiny model's text is ASCII)
    steps = [b - a for a, b in zip(lp.text_offset, lp.text_offset[1:])]
    assert steps == [len(t) for t in lp.tokens[:-1]], (lp.text_offset, lp.tokens)
    assert "".join(lp.tokens) == r.choices[0].text, (lp.tokens, r.choices[0].text)
    # the same numbers as TGI's details for the same greedy tokens
    status, j = raw("POST", "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "details": True}})
    tgi = [t["logprob"] for t in j["details"]["tokens"]]
    assert all(isinstance(v, (int, float)) and abs(a - v) < 1e-4
               for a, v in zip(lp.token_logprobs, tgi)), "OpenAI %r, TGI %r" % (
                   lp.token_logprobs, tgi)


@check
def oai_completion_echo_prompt_logprobs():
    n = len(token_ids(PROMPT))
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=0, echo=True,
                               logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == PROMPT, "echo with max_tokens 0: %r" % c.text
    lp = c.logprobs
    assert lp is not None, "logprobs is null"
    assert len(lp.tokens) == n, "%d tokens scored, the prompt has %d" % (len(lp.tokens), n)
    assert "".join(lp.tokens) == PROMPT, lp.tokens
    assert lp.token_logprobs[0] is None, "the first prompt token has no logprob: %r" % (
        lp.token_logprobs[0],)
    assert all(is_logprob(x) for x in lp.token_logprobs[1:]), lp.token_logprobs
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0, lp.text_offset
    usage_ok(r.usage, n, 0)


@check
def oai_completion_stream():
    chunks = list(OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=8,
                                         temperature=0, stream=True))
    assert chunks, "no chunks"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy(PROMPT, 8), "streamed %r" % text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"], finals
    assert all(c.usage is None for c in chunks), "a usage chunk without include_usage"


@check
def oai_completion_stream_usage():
    chunks = list(OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=8,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [], "the usage chunk has choices %r" % last.choices
    usage_ok(last.usage, len(token_ids(PROMPT)), 8)
    assert all(c.usage is None for c in chunks[:-1]), "usage before the last chunk"


@check
def oai_completion_stop():
    g = greedy(PROMPT, 16)
    k = first_new_ascii(g)
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=16, temperature=0,
                               stop=[g[k]])
    c = r.choices[0]
    assert c.finish_reason == "stop", c.finish_reason
    assert c.text == g[:k], "stop %r: %r, want %r" % (g[k], c.text, g[:k])


@check
def oai_completion_seed():
    def sample(seed):
        return OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=12,
                                      temperature=1, seed=seed).choices[0].text
    a, b, c = sample(1234), sample(1234), sample(4321)
    assert a == b, "the same seed sampled %r then %r" % (a, b)
    assert a != c, "seeds 1234 and 4321 sampled the same %r" % a


@check
def oai_completion_penalties():
    plain = greedy(PROMPT, 32)
    assert ascii_repeats(plain), "the greedy text repeats nothing, the check cannot fail: %r" % plain
    for field in ("presence_penalty", "frequency_penalty"):
        t = greedy(PROMPT, 32, **{field: 2.0})
        assert t != plain, "%s 2 changed nothing" % field
        assert not ascii_repeats(t), "%s 2: %r repeats %r" % (field, t, ascii_repeats(t))


@check
def oai_completion_logit_bias():
    ids = greedy_ids(PROMPT, 16)
    banned = {i for i in ids if 33 <= i < 127 and chr(i) not in MERGE_CHARS}
    assert banned, "no ASCII token in the greedy answer to ban"
    bias = {str(i): -100 for i in banned | {256, 257, 258}}
    t = greedy(PROMPT, 16, logit_bias=bias)
    hit = [c for c in t if ord(c) in banned]
    assert not hit, "banned tokens %r appear in %r" % (hit, t)
    # the EOS token forced: the answer ends at once
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=8, temperature=0,
                               logit_bias=EOS)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 1, \
        (r.choices[0].finish_reason, r.usage.completion_tokens)


@check
def oai_completion_logit_bias_logprobs():
    ids = greedy_ids(PROMPT, 8)
    assert 32 <= ids[0] < 127, "the greedy answer's first token %d is not ASCII" % ids[0]
    banned = chr(ids[0])
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=8, temperature=0,
                               logit_bias={str(ids[0]): -100}, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp is not None, "logprobs is null"
    assert len(lp.tokens) == 8, lp.tokens
    assert banned not in lp.tokens, "banned token %r chosen: %r" % (banned, lp.tokens)
    assert banned not in r.choices[0].text


# vLLM's extensions, which the SDK sends through extra_body

@check
def oai_completion_top_k():
    # top_k 1 at temperature 1 is greedy
    t = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=16, temperature=1,
                               seed=3, extra_body={"top_k": 1}).choices[0].text
    assert t == greedy(PROMPT, 16), "top_k 1: %r, greedy %r" % (t, greedy(PROMPT, 16))


@check
def oai_completion_min_tokens():
    # EOS forced, held off for min_tokens (the EOS itself may count)
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=10, temperature=0,
                               logit_bias=EOS, extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens in (4, 5) and r.choices[0].finish_reason == "stop", \
        (r.usage.completion_tokens, r.choices[0].finish_reason)
    assert len(r.choices[0].text) >= 4, r.choices[0].text


@check
def oai_completion_ignore_eos():
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=6, temperature=0,
                               logit_bias=EOS, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length", \
        (r.usage.completion_tokens, r.choices[0].finish_reason)


@check
def oai_completion_repetition_penalty():
    plain = greedy(PROMPT, 32)
    assert ascii_repeats(plain), "the greedy text repeats nothing: %r" % plain
    t = greedy(PROMPT, 32, extra_body={"repetition_penalty": 5.0})
    assert t != plain, "repetition_penalty 5 changed nothing"


@check
def oai_completion_skip_special_tokens():
    body = {"ignore_eos": True, "skip_special_tokens": False}
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=3, temperature=0,
                               logit_bias=EOS, extra_body=body)
    assert "<|endoftext|>" in r.choices[0].text, "skip_special_tokens false: %r" % r.choices[0].text
    body["skip_special_tokens"] = True
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=3, temperature=0,
                               logit_bias=EOS, extra_body=body)
    assert "<|endoftext|>" not in r.choices[0].text, "skip_special_tokens true: %r" % (
        r.choices[0].text,)


@check
def oai_completion_include_stop_str():
    g = greedy(PROMPT, 16)
    k = first_new_ascii(g)
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=16, temperature=0,
                               stop=[g[k]], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason
    assert r.choices[0].text == g[:k + 1], "%r, want %r" % (r.choices[0].text, g[:k + 1])


@check
def oai_completion_user_ignored():
    r = OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=6, temperature=0,
                               user="conformance-user")
    assert r.choices[0].text == greedy(PROMPT, 6)


@check
def oai_completion_suffix_refused():
    try:
        OAI.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=4, suffix="tail")
    except openai.BadRequestError as e:
        assert "suffix" in str(e), "the 400 does not name suffix: %s" % e
        return
    raise AssertionError("suffix was accepted")


# --- OpenAI SDK: chat -----------------------------------------------------------

SYSTEM_USER = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "Say hello."}]


def chat_greedy(messages, n_tokens, **extra):
    r = OAI.chat.completions.create(model=ARGS.model, messages=messages, max_tokens=n_tokens,
                                    temperature=0, **extra)
    return r.choices[0].message.content


@check
def oai_chat_basic():
    r = OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER, max_tokens=8,
                                    temperature=0)
    assert r.object == "chat.completion", r.object
    assert len(r.choices) == 1 and r.choices[0].index == 0
    m = r.choices[0].message
    assert m.role == "assistant", m.role
    assert isinstance(m.content, str) and m.content, "content %r" % m.content
    assert r.choices[0].finish_reason == "length", r.choices[0].finish_reason
    usage_ok(r.usage, chat_prompt_tokens(SYSTEM_USER), 8)


@check
def oai_chat_text_parts():
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
             {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]
    assert chat_greedy(parts, 8) == chat_greedy(SYSTEM_USER, 8), \
        "text parts and the same strings answer differently"


@check
def oai_chat_image_refused():
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
    try:
        OAI.chat.completions.create(model=ARGS.model, messages=msgs, max_tokens=4)
    except openai.BadRequestError as e:
        assert "image" in str(e), "the 400 does not name the image part: %s" % e
        return
    raise AssertionError("an image part was accepted")


@check
def oai_chat_n2():
    r = OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER, max_tokens=6, n=2,
                                    temperature=1, seed=9)
    assert [c.index for c in r.choices] == [0, 1], [c.index for c in r.choices]
    assert all(c.message.content and c.message.role == "assistant" for c in r.choices)
    assert r.choices[0].message.content != r.choices[1].message.content
    usage_ok(r.usage, chat_prompt_tokens(SYSTEM_USER), 12)


@check
def oai_chat_logprobs():
    r = OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER, max_tokens=6,
                                    temperature=0, logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content, "no logprobs.content"
    assert len(lp.content) == 6, len(lp.content)
    joined = b""
    for e in lp.content:
        assert isinstance(e.token, str), e
        assert is_logprob(e.logprob), e.logprob
        assert isinstance(e.bytes, list) and all(0 <= b < 256 for b in e.bytes), e.bytes
        joined += bytes(e.bytes)
        assert len(e.top_logprobs) == 2, e.top_logprobs
        assert all(is_logprob(t.logprob) for t in e.top_logprobs)
        assert abs(e.logprob - max(t.logprob for t in e.top_logprobs)) < 1e-4, "greedy not top"
    assert joined.decode("utf-8", errors="replace") == r.choices[0].message.content, \
        "the tokens' bytes do not spell the content"
    # the same numbers as TGI's details on the rendered conversation
    status, t = raw("POST", "/chat_tokenize", {"model": ARGS.model, "messages": SYSTEM_USER})
    status, j = raw("POST", "/generate", {"inputs": t["templated_text"], "parameters": {
        "max_new_tokens": 6, "details": True}})
    tgi = [x["logprob"] for x in j["details"]["tokens"]]
    assert all(isinstance(v, (int, float)) and abs(e.logprob - v) < 1e-4
               for e, v in zip(lp.content, tgi)), "chat %r, TGI %r" % (
                   [e.logprob for e in lp.content], tgi)


@check
def oai_chat_stream():
    want = chat_greedy(SYSTEM_USER, 8)
    chunks = list(OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER,
                                              max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk", chunks[0].object
    assert chunks[0].choices[0].delta.role == "assistant", chunks[0].choices[0].delta
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want, "streamed %r, whole %r" % (text, want)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"], finals
    assert chunks[-1].choices == [], "the last chunk is not the usage chunk"
    usage_ok(chunks[-1].usage, chat_prompt_tokens(SYSTEM_USER), 8)


# --- constrained answers and tool calls (issue 19) ------------------------------

# bounded everywhere (string lengths, list sizes, enums), so that the random
# model ends inside max_tokens whatever it draws
PET_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "ok": {"type": "boolean"},
                   "kind": {"enum": ["cat", "dog"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 2},
                            "maxItems": 2}},
    "required": ["name", "ok", "kind"],
    "additionalProperties": False,
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 8},
                                      "celsius": {"type": "boolean"}},
                       "required": ["city", "celsius"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {},
                                           "additionalProperties": False}}},
]
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# tool_choice "required" asks for a list of calls; the random model would
# make it long past max_tokens, so the checks ask for one
# (parallel_tool_calls false)


@check
def oai_chat_response_format_json_schema():
    r = OAI.chat.completions.create(
        model=ARGS.model, messages=SYSTEM_USER, max_tokens=160, temperature=1, seed=5, n=6,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}})
    assert len(r.choices) == 6, len(r.choices)
    for c in r.choices:
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        jsonschema.validate(json.loads(c.message.content), PET_SCHEMA)


def check_tool_call(call_id, name, arguments):
    assert isinstance(call_id, str) and call_id.startswith("call_"), call_id
    assert name in TOOL_PARAMS, name
    jsonschema.validate(json.loads(arguments), TOOL_PARAMS[name])


@check
def oai_chat_tools_required():
    r = OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER, max_tokens=200,
                                    temperature=1, seed=3, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.finish_reason
    assert c.message.content is None, c.message.content
    assert c.message.tool_calls, "no tool_calls"
    for call in c.message.tool_calls:
        assert call.type == "function", call.type
        check_tool_call(call.id, call.function.name, call.function.arguments)
    # a named function: one call to it
    r = OAI.chat.completions.create(
        model=ARGS.model, messages=SYSTEM_USER, max_tokens=200, temperature=1, seed=4,
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather", calls
    check_tool_call(calls[0].id, calls[0].function.name, calls[0].function.arguments)


@check
def oai_chat_tools_stream():
    chunks = list(OAI.chat.completions.create(
        model=ARGS.model, messages=SYSTEM_USER, max_tokens=200, temperature=1, seed=3,
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True))
    calls = {}
    finals = []
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            if tc.index not in calls:  # a call's first delta: id, type, name
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
            else:
                calls[tc.index][2] += tc.function.arguments or ""
        if ch.choices[0].finish_reason:
            finals.append(ch.choices[0].finish_reason)
    assert finals == ["tool_calls"], finals
    assert sorted(calls) == list(range(len(calls))) and calls, calls
    for call_id, name, arguments in calls.values():
        check_tool_call(call_id, name, arguments)
    # the same calls as the whole answer's (ids are each answer's own)
    r = OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER, max_tokens=200,
                                    temperature=1, seed=3, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False)
    whole = [[t.function.name, t.function.arguments] for t in r.choices[0].message.tool_calls]
    assert whole == [calls[i][1:] for i in sorted(calls)], (whole, calls)


@check
def oai_chat_stream_without_usage():
    chunks = list(OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER,
                                              max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in chunks), "usage without include_usage"
    assert all(c.choices for c in chunks)


@check
def oai_chat_max_completion_tokens():
    r = OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER,
                                    max_completion_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length", \
        (r.usage.completion_tokens, r.choices[0].finish_reason)


@check
def oai_chat_stop_in_stream():
    g = chat_greedy(SYSTEM_USER, 16)
    k = first_new_ascii(g)
    chunks = list(OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER,
                                              max_tokens=16, temperature=0, stream=True,
                                              stop=[g[k]]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"], finals
    assert text == g[:k], "stop %r in a stream: %r, want %r" % (g[k], text, g[:k])


@check
def oai_chat_seed():
    def sample(seed):
        return OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER, max_tokens=10,
                                           temperature=1, seed=seed).choices[0].message.content
    a, b, c = sample(77), sample(77), sample(78)
    assert a == b, "the same seed sampled %r then %r" % (a, b)
    assert a != c, "two seeds sampled the same %r" % a


@check
def oai_chat_penalties_and_bias():
    plain = chat_greedy(SYSTEM_USER, 32)
    assert ascii_repeats(plain), "the greedy answer repeats nothing: %r" % plain
    t = chat_greedy(SYSTEM_USER, 32, frequency_penalty=2.0, presence_penalty=0.5)
    assert not ascii_repeats(t), "%r repeats %r" % (t, ascii_repeats(t))
    r = OAI.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER, max_tokens=8,
                                    temperature=0, logit_bias=EOS, user="u1")
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 1


# --- the API key ------------------------------------------------------------------

@check
def oai_api_key():
    good = openai.OpenAI(base_url=ARGS.keyed + "/v1", api_key=ARGS.key, max_retries=0, timeout=60)
    assert ARGS.model in [m.id for m in good.models.list().data]
    r = good.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text == greedy(PROMPT, 4)
    r = good.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER, max_tokens=4)
    assert r.choices[0].message.content
    bad = openai.OpenAI(base_url=ARGS.keyed + "/v1", api_key="wrong-" + ARGS.key, max_retries=0,
                        timeout=60)
    for call in (lambda: bad.models.list(),
                 lambda: bad.completions.create(model=ARGS.model, prompt=PROMPT, max_tokens=2),
                 lambda: bad.chat.completions.create(model=ARGS.model, messages=SYSTEM_USER,
                                                     max_tokens=2)):
        try:
            call()
        except openai.AuthenticationError as e:
            assert e.status_code == 401, e.status_code
            continue
        raise AssertionError("a wrong key was accepted")


@check
def hf_api_key():
    good = InferenceClient(base_url=ARGS.keyed, api_key=ARGS.key, timeout=60)
    assert good.text_generation(PROMPT, max_new_tokens=4, return_full_text=False) == \
        greedy(PROMPT, 4)
    bad = InferenceClient(base_url=ARGS.keyed, api_key="wrong-" + ARGS.key, timeout=60)
    try:
        bad.text_generation(PROMPT, max_new_tokens=2)
    except huggingface_hub.errors.HfHubHTTPError as e:
        assert e.response.status_code == 401, e.response.status_code
        return
    raise AssertionError("a wrong key was accepted")


# --- OpenAI SDK: the Responses API ------------------------------------------------

RESP_TOOLS = [{"type": "function", "name": t["function"]["name"],
               "description": t["function"].get("description", ""),
               "parameters": t["function"]["parameters"], "strict": True} for t in TOOLS]


@check
def oai_responses_create():
    r = OAI.responses.create(model=ARGS.model, instructions="You are terse.", input="Say hello.",
                             max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.model == ARGS.model, r
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    # chat completions' greedy answer to the same conversation
    assert r.output_text == chat_greedy(SYSTEM_USER, 8), (r.output_text, chat_greedy(SYSTEM_USER, 8))
    assert r.usage.input_tokens == chat_prompt_tokens(SYSTEM_USER), r.usage
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8, r.usage
    # input as items, developer as system: the same prompt
    r2 = OAI.responses.create(model=ARGS.model, max_output_tokens=8, temperature=0, input=[
        {"role": "developer", "content": "You are terse."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Say hello."}]}])
    assert r2.output_text == r.output_text, (r2.output_text, r.output_text)


@check
def oai_responses_stream():
    whole = OAI.responses.create(model=ARGS.model, input="Say hello.", max_output_tokens=10,
                                 temperature=0)
    with OAI.responses.stream(model=ARGS.model, input="Say hello.", max_output_tokens=10,
                              temperature=0) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"], types
    assert types[-1] == "response.incomplete", types  # cut by max_output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events))), "sequence_number"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text, (text, whole.output_text)
    # a stream that completes (the schema ends the answer): the helpers' final response
    with OAI.responses.stream(model=ARGS.model, input="A pet.", max_output_tokens=200,
                              temperature=1, text={"format": {
                                  "type": "json_schema", "name": "pet", "schema": PET_SCHEMA,
                                  "strict": True}}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed", final
    jsonschema.validate(json.loads(final.output_text), PET_SCHEMA)


@check
def oai_responses_text_format():
    # sampled with a seed (an extension Responses accepts, as chat's): a draw
    # without one could run past max_output_tokens before the JSON closes
    r = OAI.responses.create(model=ARGS.model, input="A pet.", max_output_tokens=200,
                             temperature=1, extra_body={"seed": 5}, text={"format": {
                                 "type": "json_schema", "name": "pet", "schema": PET_SCHEMA,
                                 "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), PET_SCHEMA)
    r = OAI.responses.create(model=ARGS.model, input="An object.", max_output_tokens=200,
                             temperature=1, extra_body={"seed": 5},
                             text={"format": {"type": "json_object"}})
    assert r.status == "completed", r
    assert isinstance(json.loads(r.output_text), dict), r.output_text


@check
def oai_responses_function_tools():
    ask = dict(model=ARGS.model, input=[{"role": "user", "content": "Weather in Oslo?"}],
               tools=RESP_TOOLS, max_output_tokens=200, temperature=0)
    r = OAI.responses.create(tool_choice="required", parallel_tool_calls=False, **ask)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    check_tool_call(calls[0].call_id, calls[0].name, calls[0].arguments)
    # named, streamed: the arguments' deltas join to the done event's and the whole call's
    named = dict(ask, tool_choice={"type": "function", "name": "get_weather"})
    whole = OAI.responses.create(**named)
    with OAI.responses.stream(**named) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == deltas, (done, deltas)
    fc = [o for o in final.output if o.type == "function_call"]
    wc = [o for o in whole.output if o.type == "function_call"]
    assert len(fc) == 1 and fc[0].arguments == deltas == wc[0].arguments, (fc, wc, deltas)
    check_tool_call(fc[0].call_id, fc[0].name, fc[0].arguments)
    # the second turn: the call as it came back, and its output
    turn = ask["input"] + [calls[0].model_dump(exclude_none=True),
                           {"type": "function_call_output", "call_id": calls[0].call_id,
                            "output": "12 C, rain"}]
    second = OAI.responses.create(**dict(ask, input=turn, max_output_tokens=8))
    assert second.output_text and second.status == "incomplete", second
    # which is chat's answer to the same conversation
    chat = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": calls[0].call_id, "type": "function",
                 "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "12 C, rain"}]
    assert second.output_text == chat_greedy(chat, 8, tools=TOOLS), second.output_text


@check
def oai_responses_previous_response_id():
    first = OAI.responses.create(model=ARGS.model, instructions="You are terse.",
                                 input="Say hello.", max_output_tokens=6, temperature=0)
    assert first.store is True, first.store
    again = OAI.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text, again
    second = OAI.responses.create(model=ARGS.model, previous_response_id=first.id,
                                  input="Once more.", max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id, second
    # chat's answer to the whole conversation (the instructions are not carried over)
    chat = [{"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Once more."}]
    assert second.output_text == chat_greedy(chat, 6), (second.output_text, chat_greedy(chat, 6))
    assert second.usage.input_tokens == chat_prompt_tokens(chat), second.usage
    # streamed, continuing the second
    with OAI.responses.stream(model=ARGS.model, previous_response_id=second.id, input="Bye.",
                              max_output_tokens=4, temperature=0) as stream:
        last = list(stream)[-1]
    assert last.response.previous_response_id == second.id, last
    OAI.responses.delete(first.id)
    for call in (lambda: OAI.responses.retrieve(first.id),
                 lambda: OAI.responses.create(model=ARGS.model, previous_response_id=first.id,
                                              input="x", max_output_tokens=2)):
        try:
            call()
        except openai.NotFoundError as e:
            assert e.status_code == 404 and first.id in str(e), e
            continue
        raise AssertionError("a deleted response was found")


@check
def oai_responses_refusals():
    for extra, word in ((dict(background=True), "background"),
                        (dict(tools=[{"type": "web_search"}]), "web_search")):
        try:
            OAI.responses.create(model=ARGS.model, input="Hi", max_output_tokens=2, **extra)
        except openai.BadRequestError as e:
            assert word in str(e), e
            continue
        raise AssertionError("%s was accepted" % word)


# --- anthropic: the Messages API ------------------------------------------------

# The pinned SDK's messages.create has no temperature parameter (its
# models choose their own); the field is still Anthropic's API, sent as
# extra_body, and greedy decoding makes the answers comparable.
GREEDY = {"temperature": 0}
ANT_SYSTEM = "You are terse."
ANT_USER = [{"role": "user", "content": "Say hello."}]
ANT_TOOLS = [{"name": t["function"]["name"],
              "description": t["function"].get("description", ""),
              "input_schema": t["function"]["parameters"]} for t in TOOLS]


def ant_text(m):
    assert [b.type for b in m.content] == ["text"], m.content
    return m.content[0].text


@check
def ant_messages_create():
    m = ANT.messages.create(model=ARGS.model, max_tokens=8, system=ANT_SYSTEM, messages=ANT_USER,
                            metadata={"user_id": "u1"}, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == ARGS.model, m
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None, m
    # chat completions' greedy answer to the same conversation
    assert ant_text(m) == chat_greedy(SYSTEM_USER, 8), (ant_text(m), chat_greedy(SYSTEM_USER, 8))
    u = m.usage
    assert u.output_tokens == 8, u
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == chat_prompt_tokens(SYSTEM_USER), u
    # system as text blocks, content as text blocks: the same prompt
    m2 = ANT.messages.create(model=ARGS.model, max_tokens=8,
                             system=[{"type": "text", "text": ANT_SYSTEM}],
                             messages=[{"role": "user", "content": [
                                 {"type": "text", "text": "Say hello."}]}], extra_body=GREEDY)
    assert ant_text(m2) == ant_text(m), (ant_text(m2), ant_text(m))


@check
def ant_messages_stream():
    whole = ANT.messages.create(model=ARGS.model, max_tokens=10, system=ANT_SYSTEM,
                                messages=ANT_USER, extra_body=GREEDY)
    types, text = [], ""
    with ANT.messages.stream(model=ARGS.model, max_tokens=10, system=ANT_SYSTEM,
                             messages=ANT_USER, extra_body=GREEDY) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "text":
                text += event.text
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop", types
    for t in ("content_block_start", "content_block_delta", "content_block_stop",
              "message_delta"):
        assert t in types, (t, types)
    assert text == ant_text(whole) == ant_text(final), (text, ant_text(whole), ant_text(final))
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10, final


@check
def ant_messages_stop_sequence():
    text = ant_text(ANT.messages.create(model=ARGS.model, max_tokens=16, system=ANT_SYSTEM,
                                        messages=ANT_USER, extra_body=GREEDY))
    k = first_new_ascii(text)
    for stream in (False, True):
        kw = dict(model=ARGS.model, max_tokens=16, system=ANT_SYSTEM, messages=ANT_USER,
                  stop_sequences=["~~~~", text[k]], extra_body=GREEDY)
        if stream:
            with ANT.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = ANT.messages.create(**kw)
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == text[k], m
        assert ant_text(m) == text[:k], (ant_text(m), text[:k])


@check
def ant_tools_tool_use_then_tool_result():
    ask = dict(model=ARGS.model, max_tokens=120, system=ANT_SYSTEM, tools=ANT_TOOLS,
               messages=[{"role": "user", "content": "Weather in Oslo?"}], extra_body=GREEDY)
    m = ANT.messages.create(tool_choice={"type": "tool", "name": "get_weather"}, **ask)
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id, m.content
    jsonschema.validate(uses[0].input, TOOL_PARAMS["get_weather"])
    # streamed: the same call, its input as input_json_delta
    with ANT.messages.stream(tool_choice={"type": "tool", "name": "get_weather"}, **ask) as s:
        streamed = s.get_final_message()
    su = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and len(su) == 1, streamed
    assert su[0].name == uses[0].name and su[0].input == uses[0].input, (su, uses)
    # any: a call to one of the tools
    m_any = ANT.messages.create(tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                **ask)
    calls = [b for b in m_any.content if b.type == "tool_use"]
    assert m_any.stop_reason == "tool_use" and len(calls) == 1, m_any
    jsonschema.validate(calls[0].input, TOOL_PARAMS[calls[0].name])
    # the second turn: the assistant's content as it came back, then the result
    turn = ask["messages"] + [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": [{"type": "text", "text": "12 C, rain"}]}]}]
    second = ANT.messages.create(**dict(ask, max_tokens=8, messages=turn))
    assert second.stop_reason in ("end_turn", "max_tokens"), second
    assert [b.type for b in second.content] == ["text"], second.content
    # what the template saw is chat's tool_calls and tool message
    chat = [{"role": "system", "content": ANT_SYSTEM},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": uses[0].id, "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps(uses[0].input)}}]},
            {"role": "tool", "tool_call_id": uses[0].id, "content": "12 C, rain"}]
    n = ANT.messages.count_tokens(model=ARGS.model, system=ANT_SYSTEM, tools=ANT_TOOLS,
                                  messages=turn).input_tokens
    status, j = raw("POST", "/chat_tokenize", {"model": ARGS.model, "messages": chat,
                                               "tools": TOOLS})
    assert status == 200 and n == len(j["tokenize_response"]), (n, status, j)


@check
def ant_count_tokens():
    n = ANT.messages.count_tokens(model=ARGS.model, system=ANT_SYSTEM, messages=ANT_USER)
    assert n.input_tokens == chat_prompt_tokens(SYSTEM_USER), (n, chat_prompt_tokens(SYSTEM_USER))


@check
def ant_refusals():
    try:
        ANT.messages.create(model=ARGS.model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    except anthropic.BadRequestError as e:
        assert e.status_code == 400 and "image" in str(e), e
    else:
        raise AssertionError("an image block was accepted")
    try:
        ANT.messages.create(model="no-such-model", max_tokens=4, messages=ANT_USER)
    except anthropic.NotFoundError as e:
        assert e.status_code == 404 and "no-such-model" in str(e), e
    else:
        raise AssertionError("an unknown model was accepted")


@check
def ant_api_key():
    good = anthropic.Anthropic(base_url=ARGS.keyed, api_key=ARGS.key, max_retries=0, timeout=60)
    m = good.messages.create(model=ARGS.model, max_tokens=4, system=ANT_SYSTEM, messages=ANT_USER,
                             extra_body=GREEDY)
    assert ant_text(m) == chat_greedy(SYSTEM_USER, 4)
    bad = anthropic.Anthropic(base_url=ARGS.keyed, api_key="wrong-" + ARGS.key, max_retries=0,
                              timeout=60)
    for call in (lambda: bad.messages.create(model=ARGS.model, max_tokens=2, messages=ANT_USER),
                 lambda: bad.messages.count_tokens(model=ARGS.model, messages=ANT_USER)):
        try:
            call()
        except anthropic.AuthenticationError as e:
            assert e.status_code == 401, e.status_code
            continue
        raise AssertionError("a wrong key was accepted")


# --- reasoning kept apart (the thinking server: Qwen3's template) -------------

# the answer forced: a thought, then the answer (a regex: \n newlines)
THOUGHT, ANSWER = "add one and one", "Two it is"
FORCED = {"guided_regex": "<think>\n%s\n</think>\n\n%s" % (THOUGHT, ANSWER)}
ONE_PLUS_ONE = [{"role": "user", "content": "1+1?"}]


def thinking_server():
    if OAI_T is None:
        raise Skip("no --thinking server")


@check
def oai_chat_reasoning_content():
    thinking_server()
    r = OAI_T.chat.completions.create(model=ARGS.model, messages=ONE_PLUS_ONE, max_tokens=64,
                                      extra_body=FORCED)
    m = r.choices[0].message
    assert m.reasoning_content == THOUGHT and m.content == ANSWER, m
    reasoning, content = "", ""
    for chunk in OAI_T.chat.completions.create(model=ARGS.model, messages=ONE_PLUS_ONE,
                                               max_tokens=64, stream=True, extra_body=FORCED):
        d = chunk.choices[0].delta if chunk.choices else None
        if d is not None and getattr(d, "reasoning_content", None):
            assert not content, "reasoning after content"
            reasoning += d.reasoning_content
        if d is not None and d.content:
            content += d.content
    assert (reasoning, content) == (THOUGHT, ANSWER), (reasoning, content)
    # chat_template_kwargs reach the template: Qwen3's closed empty block
    status, off = raw("POST", "/chat_tokenize", {"messages": ONE_PLUS_ONE, "chat_template_kwargs": {
        "enable_thinking": False}}, base=ARGS.thinking)
    assert status == 200 and off["templated_text"].endswith("<think>\n\n</think>\n\n"), off


@check
def oai_responses_reasoning_item():
    thinking_server()
    r = OAI_T.responses.create(model=ARGS.model, input="1+1?", max_output_tokens=64,
                               reasoning={"effort": "medium"}, extra_body=FORCED)
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    assert r.output[0].content[0].type == "reasoning_text", r.output[0]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == ANSWER, r
    with OAI_T.responses.stream(model=ARGS.model, input="1+1?", max_output_tokens=64,
                                extra_body=FORCED) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == THOUGHT, deltas
    assert [e.sequence_number for e in events] == list(range(len(events))), "sequence_number"
    assert final.output[0].type == "reasoning" and final.output_text == ANSWER, final
    # the next turn sends the output back, reasoning item and all
    again = OAI_T.responses.create(model=ARGS.model, max_output_tokens=4, store=False,
                                   input=ONE_PLUS_ONE + [o.model_dump(exclude_none=True)
                                                         for o in r.output]
                                   + [{"role": "user", "content": "Sure?"}])
    assert again.status in ("completed", "incomplete"), again


@check
def ant_thinking_blocks():
    thinking_server()
    m = ANT_T.messages.create(model=ARGS.model, max_tokens=64, messages=ONE_PLUS_ONE,
                              thinking={"type": "enabled", "budget_tokens": 1024},
                              extra_body=FORCED)
    assert [b.type for b in m.content] == ["thinking", "text"], m.content
    assert m.content[0].thinking == THOUGHT and m.content[1].text == ANSWER, m.content
    thinking, text = "", ""
    with ANT_T.messages.stream(model=ARGS.model, max_tokens=64, messages=ONE_PLUS_ONE,
                               extra_body=FORCED) as stream:
        for event in stream:
            if event.type == "thinking":
                thinking += event.thinking
            elif event.type == "text":
                text += event.text
        final = stream.get_final_message()
    assert (thinking, text) == (THOUGHT, ANSWER), (thinking, text)
    assert [b.type for b in final.content] == ["thinking", "text"], final.content
    # a second turn sends the thinking block back; thinking disabled renders the empty block
    again = ANT_T.messages.create(model=ARGS.model, max_tokens=4, messages=ONE_PLUS_ONE + [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": "Sure?"}], thinking={"type": "disabled"})
    assert again.stop_reason == "max_tokens", again
    on = ANT_T.messages.count_tokens(model=ARGS.model, messages=ONE_PLUS_ONE)
    off = ANT_T.messages.count_tokens(model=ARGS.model, messages=ONE_PLUS_ONE,
                                      thinking={"type": "disabled"})
    assert off.input_tokens > on.input_tokens, (on, off)


# --- huggingface_hub InferenceClient: text_generation -----------------------------

def hf_greedy(prompt, n_tokens):
    return HF.text_generation(prompt, max_new_tokens=n_tokens, return_full_text=False)


@check
def hf_text_generation():
    t = HF.text_generation(PROMPT, max_new_tokens=8)
    assert isinstance(t, str) and t, "text %r" % t
    assert hf_greedy(PROMPT, 8) == greedy(PROMPT, 8), "TGI and OpenAI routes answer differently"


@check
def hf_return_full_text():
    g = greedy(PROMPT, 6)
    t = HF.text_generation(PROMPT, max_new_tokens=6, return_full_text=True)
    assert t == PROMPT + g, "return_full_text true: %r" % t
    t = HF.text_generation(PROMPT, max_new_tokens=6, return_full_text=False)
    assert t == g, "return_full_text false: %r" % t


@check
def hf_details():
    r = HF.text_generation(PROMPT, max_new_tokens=8, details=True, return_full_text=False)
    d = r.details
    assert r.generated_text == greedy(PROMPT, 8)
    assert d.finish_reason == "length", d.finish_reason
    assert d.generated_tokens == 8 and len(d.tokens) == 8, (d.generated_tokens, len(d.tokens))
    assert [t.id for t in d.tokens] == greedy_ids(PROMPT, 8)
    assert all(isinstance(t.text, str) and t.special is False for t in d.tokens)


@check
def hf_details_logprobs():
    d = HF.text_generation(PROMPT, max_new_tokens=8, details=True).details
    assert all(is_logprob(t.logprob) for t in d.tokens), [t.logprob for t in d.tokens]


@check
def hf_stream():
    parts = list(HF.text_generation(PROMPT, max_new_tokens=8, stream=True))
    assert all(isinstance(p, str) for p in parts)
    assert "".join(parts) == greedy(PROMPT, 8), "streamed %r" % parts


@check
def hf_stream_details():
    events = list(HF.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert events, "no events"
    last = events[-1]
    assert last.details is not None and last.details.finish_reason == "length", last.details
    assert last.details.generated_tokens == 8, last.details.generated_tokens
    assert last.generated_text == PROMPT + greedy(PROMPT, 8) or \
        last.generated_text == greedy(PROMPT, 8), "generated_text %r" % last.generated_text
    assert all(e.details is None and e.generated_text is None for e in events[:-1])
    # TGI sends one event per token, the last one carrying the details;
    # qlserve may end with a pseudo-token (id -1, special) carrying only
    # text it held back
    tokens = [e.token for e in events]
    if tokens[-1].id < 0:
        assert tokens[-1].special or tokens[-1].text, tokens[-1]
        tokens = tokens[:-1]
    assert [t.id for t in tokens] == greedy_ids(PROMPT, 8), [t.id for t in tokens]


@check
def hf_stream_details_input_length():
    events = list(HF.text_generation(PROMPT, max_new_tokens=2, stream=True, details=True))
    n = events[-1].details.input_length
    assert n == len(token_ids(PROMPT)), "input_length %r, the prompt has %d tokens" % (
        n, len(token_ids(PROMPT)))


@check
def hf_stream_details_logprobs():
    events = list(HF.text_generation(PROMPT, max_new_tokens=6, stream=True, details=True))
    tokens = [e.token for e in events if e.token.id >= 0]
    assert len(tokens) == 6, len(tokens)
    assert all(is_logprob(t.logprob) for t in tokens), [t.logprob for t in tokens]


@check
def hf_best_of():
    # TGI refuses a seed with best_of > 1 (each candidate draws its own)
    r = HF.text_generation(PROMPT, max_new_tokens=6, best_of=2, do_sample=True, details=True)
    d = r.details
    assert r.generated_text and d.finish_reason == "length"
    assert d.best_of_sequences is not None and len(d.best_of_sequences) == 1, d.best_of_sequences
    s = d.best_of_sequences[0]
    assert s.generated_text and s.generated_tokens == 6 and len(s.tokens) == 6
    assert all(is_logprob(t.logprob) for t in d.tokens + s.tokens)
    # the best is the one with the larger summed logprob
    assert sum(t.logprob for t in d.tokens) >= sum(t.logprob for t in s.tokens)


def attr(x, name):
    """A field of a parsed answer: huggingface_hub leaves the tokens of
    details.top_tokens (a list of lists) as dicts, the rest as objects."""
    return x[name] if isinstance(x, dict) else getattr(x, name)


@check
def hf_top_n_tokens():
    d = HF.text_generation(PROMPT, max_new_tokens=5, top_n_tokens=2, details=True).details
    assert d.top_tokens is not None and len(d.top_tokens) == 5, d.top_tokens
    for tok, top in zip(d.tokens, d.top_tokens):
        assert len(top) == 2, top
        lp = [attr(t, "logprob") for t in top]
        assert all(is_logprob(x) for x in lp), lp
        assert lp[0] >= lp[1], "top_tokens not likeliest first: %r" % lp
        assert tok.id == attr(top[0], "id"), "greedy token %d is not the top one %r" % (
            tok.id, top[0])
        assert abs(tok.logprob - lp[0]) < 1e-4, (tok.logprob, lp[0])
    events = list(HF.text_generation(PROMPT, max_new_tokens=3, top_n_tokens=2, stream=True,
                                     details=True))
    tops = [e.top_tokens for e in events if e.token.id >= 0]
    assert len(tops) == 3 and all(t is not None and len(t) == 2 for t in tops), tops
    assert all(attr(t[0], "id") == e.token.id for t, e in zip(tops, events)), "stream top_tokens"


@check
def hf_decoder_input_details():
    ids = token_ids(PROMPT)
    d = HF.text_generation(PROMPT, max_new_tokens=2, details=True,
                           decoder_input_details=True).details
    assert [p.id for p in d.prefill] == ids, "prefill %r, the prompt's ids %r" % (
        [p.id for p in d.prefill], ids)
    assert d.prefill[0].logprob is None, d.prefill[0].logprob
    assert all(is_logprob(p.logprob) for p in d.prefill[1:]), [p.logprob for p in d.prefill]


@check
def hf_truncate():
    ids = token_ids(PROMPT)
    assert len(ids) > 4
    tail = "".join(t["text"] for t in raw("POST", "/tokenize", {"inputs": PROMPT})[1][-4:])
    assert token_ids(tail) == ids[-4:], "the prompt's last 4 tokens do not re-tokenize alone"
    t = HF.text_generation(PROMPT, max_new_tokens=6, truncate=4, return_full_text=False)
    assert t == hf_greedy(tail, 6), "truncate 4 is not the last 4 tokens: %r" % t
    d = HF.text_generation(PROMPT, max_new_tokens=1, truncate=4, details=True,
                           decoder_input_details=True).details
    assert len(d.prefill) == 4, "prefill of %d tokens" % len(d.prefill)


@check
def hf_typical_p():
    a = HF.text_generation(PROMPT, max_new_tokens=8, do_sample=True, typical_p=0.9, seed=4)
    b = HF.text_generation(PROMPT, max_new_tokens=8, do_sample=True, typical_p=0.9, seed=4)
    assert a and a == b, (a, b)


@check
def hf_watermark_false():
    t = HF.text_generation(PROMPT, max_new_tokens=6, watermark=False, return_full_text=False)
    assert t == greedy(PROMPT, 6)


@check
def hf_stop_sequences():
    g = greedy(PROMPT, 16)
    k = first_new_ascii(g)
    d = HF.text_generation(PROMPT, max_new_tokens=16, stop=[g[k]], details=True,
                           return_full_text=False)
    assert d.details.finish_reason == "stop_sequence", d.details.finish_reason
    # TGI keeps the stop sequence in the text
    assert d.generated_text in (g[:k + 1], g[:k]), "%r, want %r" % (d.generated_text, g[:k + 1])


@check
def hf_seed():
    def sample(seed):
        return HF.text_generation(PROMPT, max_new_tokens=10, do_sample=True, temperature=1.0,
                                  seed=seed, details=True)
    a, b, c = sample(99), sample(99), sample(98)
    assert a.generated_text == b.generated_text, (a.generated_text, b.generated_text)
    assert a.generated_text != c.generated_text
    assert a.details.seed == 99, a.details.seed


@check
def hf_penalties():
    plain = hf_greedy(PROMPT, 32)
    assert ascii_repeats(plain), "the greedy text repeats nothing: %r" % plain
    t = HF.text_generation(PROMPT, max_new_tokens=32, frequency_penalty=2.0,
                           return_full_text=False)
    assert not ascii_repeats(t), "frequency_penalty 2: %r repeats %r" % (t, ascii_repeats(t))
    t = HF.text_generation(PROMPT, max_new_tokens=32, repetition_penalty=5.0,
                           return_full_text=False)
    assert t != plain, "repetition_penalty 5 changed nothing"


# --- huggingface_hub InferenceClient: chat and the endpoint ------------------------

@check
def hf_chat_completion():
    r = HF.chat_completion(SYSTEM_USER, max_tokens=8, temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant" and m.content, m
    assert m.content == chat_greedy(SYSTEM_USER, 8), "the two clients' chats differ"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == chat_prompt_tokens(SYSTEM_USER)
    assert r.usage.completion_tokens == 8


@check
def hf_grammar():
    # TGI's shapes: parameters.grammar on text_generation, and the
    # Messages API's response_format {"type": "json", "value": SCHEMA}
    t = HF.text_generation(PROMPT, max_new_tokens=12, do_sample=True, seed=2,
                           return_full_text=False,
                           grammar={"type": "regex", "value": "(yes|no)-[0-9]{2}"})
    assert t[:4] == "yes-" or t[:3] == "no-", t
    assert t.split("-")[1].isdigit() and len(t.split("-")[1]) == 2, t
    t = HF.text_generation(PROMPT, max_new_tokens=160, do_sample=True, seed=3,
                           return_full_text=False, grammar={"type": "json", "value": PET_SCHEMA})
    jsonschema.validate(json.loads(t), PET_SCHEMA)
    r = HF.chat_completion(SYSTEM_USER, max_tokens=160, temperature=1, seed=4,
                           response_format={"type": "json", "value": PET_SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].message.content), PET_SCHEMA)


@check
def hf_chat_completion_stream():
    chunks = list(HF.chat_completion(SYSTEM_USER, max_tokens=8, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_greedy(SYSTEM_USER, 8), "streamed %r" % text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason] == ["length"]


@check
def hf_tokenize():
    if not hasattr(HF, "tokenize"):
        raise Skip("InferenceClient %s has no tokenize" % huggingface_hub.__version__)
    toks = HF.tokenize(PROMPT)
    assert [t.id for t in toks] == token_ids(PROMPT)


# the client's endpoint helpers want the provider named even with base_url
def hf_endpoint():
    return InferenceClient(base_url=ARGS.base, provider="hf-inference", timeout=60)


@check
def hf_health_check():
    assert hf_endpoint().health_check() is True


@check
def hf_endpoint_info():
    info = hf_endpoint().get_endpoint_info()
    assert info.get("model_id") == ARGS.model, info.get("model_id")
    assert isinstance(info.get("version"), str) and info["version"], info.get("version")
    for field in ("max_input_tokens", "max_total_tokens", "max_best_of", "max_stop_sequences",
                  "max_concurrent_requests"):
        assert isinstance(info.get(field), int) and info[field] > 0, "%s: %r" % (
            field, info.get(field))
    assert info["max_input_tokens"] < info["max_total_tokens"], info


# --- the runner -------------------------------------------------------------------

def main():
    global ARGS, OAI, HF, ANT, OAI_T, ANT_T
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--keyed", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--thinking", help="a server with Qwen3's chat template")
    ARGS = p.parse_args()
    # no retries: a failure shows as it happened
    OAI = openai.OpenAI(base_url=ARGS.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    HF = InferenceClient(base_url=ARGS.base, timeout=60)
    ANT = anthropic.Anthropic(base_url=ARGS.base, api_key="unused", max_retries=0, timeout=60)
    if ARGS.thinking:
        OAI_T = openai.OpenAI(base_url=ARGS.thinking + "/v1", api_key="unused", max_retries=0,
                              timeout=60)
        ANT_T = anthropic.Anthropic(base_url=ARGS.thinking, api_key="unused", max_retries=0,
                                    timeout=60)
    print("conformance: openai %s, huggingface_hub %s, anthropic %s" % (
        openai.__version__, huggingface_hub.__version__, anthropic.__version__))
    passed, failed, skipped = [], [], []
    for fn in CHECKS:
        t0 = time.monotonic()
        try:
            fn()
        except Skip as e:
            skipped.append(fn.__name__)
            print("SKIP %s: %s" % (fn.__name__, e), flush=True)
            continue
        except AssertionError as e:
            tb = traceback.extract_tb(e.__traceback__)[-1]
            failed.append(fn.__name__)
            print("FAIL %s: line %d: %s" % (fn.__name__, tb.lineno, str(e) or tb.line), flush=True)
            continue
        except Exception as e:  # the client raised: an HTTP error, a shape it cannot parse
            failed.append(fn.__name__)
            msg = " ".join(str(e).split())
            print("FAIL %s: %s: %s" % (fn.__name__, type(e).__name__, msg[:400]), flush=True)
            continue
        passed.append(fn.__name__)
        print("PASS %s (%.2f s)" % (fn.__name__, time.monotonic() - t0), flush=True)
    print("conformance: %d passed, %d failed, %d skipped of %d checks" % (
        len(passed), len(failed), len(skipped), len(CHECKS)))
    if failed:
        print("conformance: failed: %s" % " ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
