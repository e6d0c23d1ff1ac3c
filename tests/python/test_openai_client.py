"""The official `openai` Python client against a running Baton gateway: chat and
legacy completions.

Usage: BATON_URL=http://127.0.0.1:PORT BATON_API_KEY=bk-... python3 test_openai_client.py
Exits 0 when every check passes; prints what failed otherwise. Run by
tests/gateway/gateway_python.rs, which starts the gateway.
"""
import os
import sys

import openai

base = os.environ["BATON_URL"].rstrip("/") + "/v1"
client = openai.OpenAI(base_url=base, api_key=os.environ["BATON_API_KEY"])
messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colors."},
]

models = client.models.list()
model = models.data[0].id

full = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, seed=1)
text = full.choices[0].message.content
assert text, "empty non-streaming reply"
assert full.choices[0].finish_reason in ("stop", "length"), full.choices[0].finish_reason
assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens > 0

lp = client.chat.completions.create(
    model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
)
content = lp.choices[0].logprobs.content
assert content and len(content) == lp.usage.completion_tokens, content
assert all(len(c.top_logprobs) == 3 for c in content)
assert all(c.logprob <= 0 for c in content)

chunks = []
usage = None
stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=12, temperature=0, seed=1,
    stream=True, stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.content:
            chunks.append(choice.delta.content)
streamed = "".join(chunks)
assert streamed == text, (streamed, text)
assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0, usage

try:
    client.chat.completions.create(model=model, messages=[], max_tokens=1)
    raise AssertionError("empty messages accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400

# Legacy completions: a raw prompt, non-streaming and streaming give the same text.
prompt = "The three primary colors are"
cmpl = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
assert cmpl.object == "text_completion", cmpl.object
ctext = cmpl.choices[0].text
assert ctext, "empty completion"
assert cmpl.choices[0].finish_reason in ("stop", "length"), cmpl.choices[0].finish_reason
clp = cmpl.choices[0].logprobs
assert len(clp.tokens) == len(clp.token_logprobs) == len(clp.top_logprobs) == len(clp.text_offset) == cmpl.usage.completion_tokens
assert all(lp <= 0 for lp in clp.token_logprobs)
cparts = []
cusage = None
for chunk in client.completions.create(
    model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
):
    if chunk.usage is not None:
        cusage = chunk.usage
    for choice in chunk.choices:
        cparts.append(choice.text)
assert "".join(cparts) == ctext, (cparts, ctext)
assert cusage is not None and cusage.completion_tokens == cmpl.usage.completion_tokens, cusage
try:
    client.completions.create(model=model, prompt=prompt, max_tokens=4, n=2)
    raise AssertionError("n=2 accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400

bad = openai.OpenAI(base_url=base, api_key="bk-wrong")
try:
    bad.models.list()
    raise AssertionError("wrong key accepted")
except openai.AuthenticationError:
    pass

print("openai client: ok")
