"""The official `openai` Python client's Responses and Conversations APIs against a
running Baton gateway: create (plain, streamed, with the stream helper), chains by
previous_response_id and by conversation with their cached tokens, a branch, retrieve
(and a resumed stream), input items, cancel, delete, idempotency, store=false;
conversations create (with items and metadata), retrieve, update, delete and their
items create, list, retrieve and delete; owner isolation and the 400s that name an
unsupported field.

Usage: BATON_URL=http://127.0.0.1:PORT BATON_API_KEY=bk-... BATON_API_KEY2=bk-...
python3 test_openai_responses.py
Exits 0 when every check passes. Run by tests/gateway/gateway_python.rs, which starts
the gateway (the two keys are two users).
"""
import os
import time

import openai

base = os.environ["BATON_URL"].rstrip("/") + "/v1"
alice = openai.OpenAI(base_url=base, api_key=os.environ["BATON_API_KEY"], max_retries=0)
bob = openai.OpenAI(base_url=base, api_key=os.environ["BATON_API_KEY2"], max_retries=0)
model = alice.models.list().data[0].id
QUESTIONS = [
    "Name three colors.",
    "Now name three animals.",
    "And three fruits?",
    "Which of those is your favorite?",
]


def expect(error, call, param=None):
    try:
        call()
    except error as e:
        if param is not None:
            assert e.param == param, (e.param, param, e.message)
        return e
    raise AssertionError(f"expected {error.__name__}")


# Non-streamed.
r1 = alice.responses.create(model=model, input=QUESTIONS[0], max_output_tokens=12, temperature=0)
assert r1.object == "response" and r1.status in ("completed", "incomplete"), r1.status
assert r1.output_text, "empty reply"
assert r1.usage.input_tokens > 0 and r1.usage.output_tokens > 0, r1.usage
assert r1.output[0].type == "message" and r1.output[0].role == "assistant"

# Streamed: the typed events in order, sequence numbers from 0 without gaps, the same
# greedy text, and the same prompt now warm.
events = list(alice.responses.create(model=model, input=QUESTIONS[0], max_output_tokens=12, temperature=0, stream=True))
types = [e.type for e in events]
assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"], types
assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", types[-1]], types
assert types[-1] in ("response.completed", "response.incomplete"), types
assert [e.sequence_number for e in events] == list(range(len(events)))
streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert streamed == r1.output_text, (streamed, r1.output_text)
final = events[-1].response
assert final.output_text == streamed
assert final.usage.input_tokens_details.cached_tokens > 0, final.usage

# The SDK's stream helper, which rebuilds the response from the events.
with alice.responses.stream(model=model, input=QUESTIONS[0], max_output_tokens=12, temperature=0) as s:
    last = [e for e in s][-1]
# (get_final_response() needs `response.completed`; a reply cut at max_output_tokens
# ends `response.incomplete`, as OpenAI's does.)
assert last.type in ("response.completed", "response.incomplete"), last.type
assert last.response.output_text == r1.output_text, (last.response.output_text, r1.output_text)

# A 4-turn chain by previous_response_id: each turn sends only its new message, and
# turns 2-4 find every earlier turn in the cache (all but the last partial KV block).
chain = [r1]
for q in QUESTIONS[1:]:
    prev = chain[-1]
    r = alice.responses.create(model=model, input=q, previous_response_id=prev.id, max_output_tokens=12, temperature=0)
    earlier = prev.usage.input_tokens + prev.usage.output_tokens
    cached = r.usage.input_tokens_details.cached_tokens
    assert r.usage.input_tokens > earlier, (r.usage, prev.usage)
    assert cached >= earlier - 16, f"turn {len(chain) + 1}: cached {cached} of {earlier} earlier tokens"
    assert r.previous_response_id == prev.id
    chain.append(r)
print("chain cached_tokens:", [r.usage.input_tokens_details.cached_tokens for r in chain[1:]],
      "of input_tokens:", [r.usage.input_tokens for r in chain[1:]])

# A 4-turn chain by conversation (one made through the Conversations API's create).
conv = alice.conversations.create()
by_conv = []
for q in QUESTIONS:
    r = alice.responses.create(model=model, input=q, conversation=conv.id, max_output_tokens=12, temperature=0)
    assert r.conversation.id == conv.id and r.id.split("__")[0] == "resp_" + conv.id
    if by_conv:
        prev = by_conv[-1]
        earlier = prev.usage.input_tokens + prev.usage.output_tokens
        assert r.usage.input_tokens_details.cached_tokens >= earlier - 16, (r.usage, prev.usage)
    by_conv.append(r)
assert [r.output_text for r in by_conv] == [r.output_text for r in chain], "the same greedy chain either way"
expect(openai.NotFoundError, lambda: bob.responses.create(model=model, input="x", conversation=conv.id), "conversation")
assert alice.conversations.retrieve(conv.id).id == conv.id
expect(openai.NotFoundError, lambda: bob.conversations.retrieve(conv.id))
alice.conversations.delete(conv.id)
expect(openai.NotFoundError, lambda: alice.responses.retrieve(by_conv[0].id))

# A response's metadata is stored with it.
tagged = alice.responses.create(model=model, input="Say hi.", max_output_tokens=4, temperature=0, metadata={"run": "t1"})
assert tagged.metadata == {"run": "t1"} and alice.responses.retrieve(tagged.id).metadata == {"run": "t1"}

# Retrieve, input items, a resumed stream.
got = alice.responses.retrieve(chain[2].id)
assert got.output_text == chain[2].output_text and got.previous_response_id == chain[1].id
assert got.usage.input_tokens_details.cached_tokens == chain[2].usage.input_tokens_details.cached_tokens
items = alice.responses.input_items.list(chain[2].id)
assert items.data[0].role == "user" and items.data[0].content[0].text == QUESTIONS[2], items
resumed = list(alice.responses.retrieve(chain[3].id, stream=True, starting_after=5))
assert [e.sequence_number for e in resumed][0] == 6 and resumed[-1].type in ("response.completed", "response.incomplete")
replayed = list(alice.responses.retrieve(chain[3].id, stream=True))
assert "".join(e.delta for e in replayed if e.type == "response.output_text.delta") == chain[3].output_text

# A branch from turn 2 after turn 4 exists: a new conversation with turns 1-2's history;
# the original chain is untouched.
branch = alice.responses.create(model=model, input="Name three cities.", previous_response_id=chain[1].id, max_output_tokens=12, temperature=0)
assert branch.id.split("__")[0] != chain[1].id.split("__")[0], "a branch must be a new conversation"
assert branch.usage.input_tokens_details.cached_tokens >= chain[1].usage.input_tokens, branch.usage
assert alice.responses.retrieve(chain[3].id).output_text == chain[3].output_text
assert alice.responses.retrieve(chain[2].id).previous_response_id == chain[1].id
after_branch = alice.responses.create(model=model, input="One more.", previous_response_id=branch.id, max_output_tokens=4, temperature=0)
assert after_branch.id.split("__")[0] == branch.id.split("__")[0]

# Idempotency: the same key and body give the same response, once.
k = {"Idempotency-Key": "responses-test-1"}
i1 = alice.responses.create(model=model, input="Say hi.", max_output_tokens=6, temperature=0, extra_headers=k)
i2 = alice.responses.create(model=model, input="Say hi.", max_output_tokens=6, temperature=0, extra_headers=k)
assert i1.id == i2.id and i1.output_text == i2.output_text
expect(openai.ConflictError, lambda: alice.responses.create(model=model, input="Say bye.", max_output_tokens=6, extra_headers=k))

# Cancel of a finished response answers it as stored.
assert alice.responses.cancel(i1.id).id == i1.id

# Owner isolation: bob cannot read, continue, branch, list or delete alice's responses.
expect(openai.NotFoundError, lambda: bob.responses.retrieve(chain[0].id))
expect(openai.NotFoundError, lambda: bob.responses.input_items.list(chain[0].id))
expect(openai.NotFoundError, lambda: bob.responses.delete(chain[0].id))
expect(openai.NotFoundError, lambda: bob.responses.cancel(chain[0].id))
expect(openai.NotFoundError, lambda: bob.responses.create(model=model, input="x", previous_response_id=chain[3].id), "previous_response_id")
expect(openai.NotFoundError, lambda: bob.responses.create(model=model, input="x", previous_response_id=chain[0].id), "previous_response_id")
assert alice.responses.retrieve(chain[0].id).output_text == r1.output_text

# Unsupported requests are 400s naming the field.
for field, kwargs in [
    ("tools", {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]}),
    ("background", {"background": True}),
    ("reasoning", {"reasoning": {"effort": "high"}}),
    ("text", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}),
    ("input", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]}),
]:
    args = {"model": model, "input": "hi", **kwargs}
    e = expect(openai.BadRequestError, lambda: alice.responses.create(**args), field)
    assert field in e.message, e.message

# store=false: answered, then not kept.
unstored = alice.responses.create(model=model, input="Say hi.", max_output_tokens=4, store=False)
for _ in range(50):
    try:
        alice.responses.retrieve(unstored.id)
        time.sleep(0.1)
    except openai.NotFoundError:
        break
else:
    raise AssertionError("a store=false response stayed retrievable")

# Delete: the response (and its conversation's chain) is gone; the branch stays.
alice.responses.delete(chain[3].id)
expect(openai.NotFoundError, lambda: alice.responses.retrieve(chain[3].id))
expect(openai.NotFoundError, lambda: alice.responses.retrieve(chain[0].id))
assert alice.responses.retrieve(branch.id).output_text == branch.output_text

# The Conversations API: a conversation made with metadata and a first user item, the
# response that answers it, items added, listed, retrieved and deleted.
c = alice.conversations.create(metadata={"topic": "demo"}, items=[{"type": "message", "role": "user", "content": "Hello!"}])
assert c.object == "conversation" and c.metadata == {"topic": "demo"}, c
got = alice.conversations.retrieve(c.id)
assert got.id == c.id and got.metadata == {"topic": "demo"} and got.created_at == c.created_at, got
upd = alice.conversations.update(c.id, metadata={"topic": "colors", "n": "2"})
assert upd.id == c.id and upd.metadata == {"topic": "colors", "n": "2"}, upd
assert alice.conversations.retrieve(c.id).metadata == {"topic": "colors", "n": "2"}
listed = alice.conversations.items.list(c.id, order="asc")
assert [(i.role, i.content[0].text) for i in listed.data] == [("user", "Hello!")], listed
hello_id = listed.data[0].id
c1 = alice.responses.create(model=model, input=QUESTIONS[0], conversation=c.id, max_output_tokens=12, temperature=0)
assert c1.output_text and c1.conversation.id == c.id
every = [(i.id, i.role, i.content[0].text) for i in alice.conversations.items.list(c.id, order="asc", limit=1)]  # pages of 1
assert [(r, t) for _, r, t in every] == [("user", "Hello!"), ("user", QUESTIONS[0]), ("assistant", c1.output_text)], every
assert every[2][0] == c1.output[0].id, "a response's output message is the conversation's item"
newest = alice.conversations.items.list(c.id, limit=1)
assert newest.data[0].id == c1.output[0].id and newest.has_more, "items list newest first by default"
added = alice.conversations.items.create(
    c.id,
    items=[
        {"type": "message", "role": "user", "content": "Remember the number 7."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "I will remember 7."}]},
    ],
)
assert [(i.role, i.content[0].text) for i in added.data] == [("user", "Remember the number 7."), ("assistant", "I will remember 7.")], added
one = alice.conversations.items.retrieve(added.data[1].id, conversation_id=c.id)
assert one.id == added.data[1].id and one.role == "assistant" and one.content[0].text == "I will remember 7.", one
c2 = alice.responses.create(model=model, input="What number?", conversation=c.id, max_output_tokens=8, temperature=0)
earlier = c1.usage.input_tokens + c1.usage.output_tokens
assert c2.usage.input_tokens > earlier + 10, (c2.usage, c1.usage)
assert c2.usage.input_tokens_details.cached_tokens >= earlier - 16, ("the answered turn stays warm after items", c2.usage, c1.usage)
# Deleting an item: gone from the list, the rest kept with their IDs, the conversation
# still answers (its KV was evicted: the next turn computes the history again).
after = alice.conversations.items.delete(added.data[1].id, conversation_id=c.id)
assert after.id == c.id and after.metadata == {"topic": "colors", "n": "2"}, after
ids = [i.id for i in alice.conversations.items.list(c.id, order="asc")]
assert added.data[1].id not in ids and ids == [hello_id, every[1][0], every[2][0], added.data[0].id, c2.output[0].id.replace("msg_", "msgin_"), c2.output[0].id], ids
expect(openai.NotFoundError, lambda: alice.conversations.items.retrieve(added.data[1].id, conversation_id=c.id))
c3 = alice.responses.create(model=model, input="Say ok.", conversation=c.id, max_output_tokens=4, temperature=0)
assert c3.status in ("completed", "incomplete") and c3.usage.input_tokens > c2.usage.input_tokens - 20, c3.usage
assert alice.responses.retrieve(c2.id).output_text == c2.output_text, "a response keeps its ID through an item deletion"
# Owner isolation: bob sees none of it, changes none of it.
expect(openai.NotFoundError, lambda: bob.conversations.retrieve(c.id))
expect(openai.NotFoundError, lambda: bob.conversations.update(c.id, metadata={"topic": "bob"}))
expect(openai.NotFoundError, lambda: bob.conversations.items.list(c.id))
expect(openai.NotFoundError, lambda: bob.conversations.items.retrieve(hello_id, conversation_id=c.id))
expect(openai.NotFoundError, lambda: bob.conversations.items.create(c.id, items=[{"role": "user", "content": "hi"}]))
expect(openai.NotFoundError, lambda: bob.conversations.items.delete(hello_id, conversation_id=c.id))
expect(openai.NotFoundError, lambda: bob.conversations.delete(c.id))
assert alice.conversations.retrieve(c.id).metadata == {"topic": "colors", "n": "2"}
assert len(alice.conversations.items.list(c.id).data) == len(ids) + 2
# What the store cannot keep is a 400 that names the field.
expect(openai.BadRequestError, lambda: alice.conversations.create(items=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]), "items")
expect(openai.BadRequestError, lambda: alice.conversations.create(items=[{"role": "developer", "content": "be terse"}]), "items")
expect(openai.BadRequestError, lambda: alice.conversations.update(c.id, metadata={"k": "x" * 600}), "metadata")
expect(openai.BadRequestError, lambda: alice.conversations.items.create(c.id, items=[{"type": "function_call_output", "call_id": "x", "output": "y"}]), "items")
gone = alice.conversations.delete(c.id)
assert gone.deleted and gone.object == "conversation.deleted" and gone.id == c.id
expect(openai.NotFoundError, lambda: alice.conversations.retrieve(c.id))
expect(openai.NotFoundError, lambda: alice.conversations.items.list(c.id))
expect(openai.NotFoundError, lambda: alice.responses.retrieve(c1.id))
print("conversations: items", len(ids), "cached after items", c2.usage.input_tokens_details.cached_tokens, "of", c2.usage.input_tokens)

print("openai responses: ok")
