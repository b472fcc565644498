#!/usr/bin/env python3
"""Checks dcd's OpenAI-compatible API with the official `openai` Python client.

Run by tests/tests/openai_api.rs against a real daemon:

    python3 tests/python/openai_client.py '<config json>'

The config gives `api` (the control API's base URL), `model` (the name /v1/models must list),
`chat_messages` and `chat_prompt_ids` (those messages rendered with the model's chat template
and tokenized by the Rust side, so that a chat completion can be compared with a completion of
exactly those ids). Prints one JSON summary on stdout and exits 1 if any check failed, 2 on
bad usage, 3 if the `openai` or `jsonschema` package is missing. The JSON schema checks
validate with `jsonschema`, an implementation of JSON Schema that is not dcd's.
"""

import json
import sys
import traceback

try:
    import jsonschema
    import openai
    from openai import OpenAI
except ImportError as e:
    print(json.dumps({"ok": False, "error": f"a Python package is not installed: {e.name}"}))
    sys.exit(3)


class Checks:
    """Collects named checks; a section that raises fails as a whole and the rest still run."""

    def __init__(self):
        self.results = []

    def check(self, name, ok, detail=""):
        self.results.append({"name": name, "ok": bool(ok), "detail": str(detail)[:2000]})
        return bool(ok)

    def section(self, name, fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 - any failure is a failed check, reported
            self.check(name, False, traceback.format_exc()[-2000:])

    def ok(self):
        return bool(self.results) and all(r["ok"] for r in self.results)



def with_budget(kw, i, tight, roomy):
    """Ask number `i`'s budget and sampling: every fourth greedy on a tight budget, the others
    greedy and seeded in turn on a roomy one."""
    if i % 4 == 3:
        kw.update(max_tokens=tight, temperature=0)
    elif i % 2:
        kw.update(max_tokens=roomy, temperature=0.8, seed=i)
    else:
        kw.update(max_tokens=roomy, temperature=0)
    return kw

def chat_stream(client, **kw):
    """Concatenated content, finish reason, first delta's role and usage of a streamed chat."""
    text, finish, role, usage, chunks = "", None, None, None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if c.delta.role and role is None:
            role = c.delta.role
        if c.delta.content:
            text += c.delta.content
        if c.finish_reason:
            finish = c.finish_reason
    return text, finish, role, usage, chunks


def completion_stream(client, **kw):
    """Concatenated text, finish reason and usage of a streamed completion."""
    text, finish, usage = "", None, None
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text += c.text or ""
        if c.finish_reason:
            finish = c.finish_reason
    return text, finish, usage


def usage_adds_up(u):
    return u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    cfg = json.loads(sys.argv[1])
    model = cfg["model"]
    messages = cfg["chat_messages"]
    chat_ids = cfg["chat_prompt_ids"]
    # No retries: a refused request must show, not be hidden by the client's backoff.
    client = OpenAI(base_url=f"{cfg['api']}/v1", api_key="unused", max_retries=0, timeout=600)
    c = Checks()
    texts = {}

    def models():
        listed = client.models.list()
        ids = [m.id for m in listed.data]
        c.check("models.list names the model", ids == [model], ids)
        m = listed.data[0]
        extra = m.model_extra or {}
        c.check("model has owned_by", isinstance(m.owned_by, str) and m.owned_by, m.owned_by)
        c.check("model has created", isinstance(m.created, int) and m.created > 0, m.created)
        mid = extra.get("model_id", "")
        c.check(
            "model has the DaisyChain model id",
            isinstance(mid, str) and len(mid) == 64 and all(ch in "0123456789abcdef" for ch in mid),
            mid,
        )
        c.check("models.retrieve", client.models.retrieve(model).id == model)

    def chat():
        kw = dict(model=model, messages=messages, temperature=0, max_tokens=24)
        a = client.chat.completions.create(**kw)
        ch = a.choices[0]
        texts["chat"] = ch.message.content
        c.check("chat object", a.object == "chat.completion", a.object)
        c.check("chat id", a.id.startswith("chatcmpl-"), a.id)
        c.check("chat model", a.model == model, a.model)
        c.check("chat one choice", len(a.choices) == 1, len(a.choices))
        c.check("chat role", ch.message.role == "assistant", ch.message.role)
        c.check("chat text", isinstance(ch.message.content, str) and ch.message.content.strip(), ch.message.content)
        c.check("chat finish_reason", ch.finish_reason in ("stop", "length"), ch.finish_reason)
        c.check("chat usage adds up", usage_adds_up(a.usage), a.usage)
        c.check("chat prompt_tokens", a.usage.prompt_tokens == len(chat_ids), (a.usage.prompt_tokens, len(chat_ids)))
        n = a.usage.completion_tokens
        c.check(
            "chat completion_tokens",
            0 < n <= 24 and (ch.finish_reason != "length" or n == 24),
            (n, ch.finish_reason),
        )
        b = client.chat.completions.create(**kw)
        c.check("chat greedy is deterministic", b.choices[0].message.content == ch.message.content,
                (b.choices[0].message.content, ch.message.content))
        text, finish, role, usage, chunks = chat_stream(client, stream_options={"include_usage": True}, **kw)
        c.check("chat stream equals non-streaming", text == ch.message.content, (text, ch.message.content))
        c.check("chat stream finish_reason", finish == ch.finish_reason, (finish, ch.finish_reason))
        c.check("chat stream role", role == "assistant", role)
        c.check("chat stream has several chunks", chunks > 2, chunks)
        c.check(
            "chat stream usage",
            usage is not None and usage.model_dump() == a.usage.model_dump(),
            (usage, a.usage),
        )
        # The chat template, rendered by the Rust side: a completion of those ids is the same
        # generation.
        d = client.completions.create(model=model, prompt=chat_ids, temperature=0, max_tokens=24)
        c.check("chat equals completion of the rendered template", d.choices[0].text == ch.message.content,
                (d.choices[0].text, ch.message.content))
        c.check("token-id prompt_tokens", d.usage.prompt_tokens == len(chat_ids), d.usage)

    def completions():
        kw = dict(model=model, prompt="The three primary colours are", temperature=0, max_tokens=32)
        a = client.completions.create(**kw)
        ch = a.choices[0]
        texts["completion"] = ch.text
        c.check("completion object", a.object == "text_completion", a.object)
        c.check("completion id", a.id.startswith("cmpl-"), a.id)
        c.check("completion text", isinstance(ch.text, str) and ch.text.strip(), ch.text)
        c.check("completion finish_reason", ch.finish_reason in ("stop", "length"), ch.finish_reason)
        c.check("completion usage adds up", usage_adds_up(a.usage), a.usage)
        c.check("completion prompt_tokens", a.usage.prompt_tokens > 0, a.usage)
        b = client.completions.create(**kw)
        c.check("completion greedy is deterministic", b.choices[0].text == ch.text, (b.choices[0].text, ch.text))
        text, finish, usage = completion_stream(client, stream_options={"include_usage": True}, **kw)
        c.check("completion stream equals non-streaming", text == ch.text, (text, ch.text))
        c.check("completion stream finish_reason", finish == ch.finish_reason, (finish, ch.finish_reason))
        c.check("completion stream usage", usage is not None and usage.model_dump() == a.usage.model_dump(),
                (usage, a.usage))
        # The same prompt as a one-element list.
        e = client.completions.create(model=model, prompt=[kw["prompt"]], temperature=0, max_tokens=32)
        c.check("completion prompt as a list", e.choices[0].text == ch.text, e.choices[0].text)

    def max_tokens():
        a = client.completions.create(model=model, prompt="Once upon a time", temperature=0, max_tokens=5)
        ch = a.choices[0]
        c.check("max_tokens gives finish_reason length", ch.finish_reason == "length", ch.finish_reason)
        c.check("max_tokens bounds completion_tokens", a.usage.completion_tokens == 5, a.usage)
        text, finish = chat_stream(client, model=model, messages=messages, temperature=0, max_tokens=3)[:2]
        c.check("chat stream max_tokens gives length", finish == "length", (text, finish))

    def stop_strings():
        kw = dict(model=model, prompt="Once upon a time", temperature=0)
        full = client.completions.create(max_tokens=40, **kw).choices[0].text
        texts["story"] = full
        # A stop string from the second half of the greedy text: the same generation must stop
        # at its first occurrence, cut just before it.
        if not c.check("stop: the story is long enough", len(full) >= 40, full):
            return
        k = len(full) // 2
        stop = full[k:k + 4]
        expected = full[: full.index(stop)]
        a = client.completions.create(max_tokens=40, stop=stop, **kw)
        ch = a.choices[0]
        c.check("stop cuts the text", ch.text == expected, (stop, ch.text, expected))
        c.check("stop gives finish_reason stop", ch.finish_reason == "stop", ch.finish_reason)
        c.check("stop ends generation early", a.usage.completion_tokens < 40, a.usage)
        b = client.completions.create(max_tokens=40, stop=["never-in-this-text", stop], **kw)
        c.check("stop list", b.choices[0].text == expected, b.choices[0].text)
        text, finish, _ = completion_stream(client, max_tokens=40, stop=[stop], **kw)
        c.check("stop while streaming", text == expected and finish == "stop", (text, finish))
        chat = texts.get("chat") or ""
        if len(chat) >= 8:
            s2 = chat[len(chat) // 2:len(chat) // 2 + 3]
            d = client.chat.completions.create(
                model=model, messages=messages, temperature=0, max_tokens=24, stop=[s2])
            c.check("chat stop", d.choices[0].message.content == chat[: chat.index(s2)]
                    and d.choices[0].finish_reason == "stop", (s2, d.choices[0].message.content))

    def seeds():
        kw = dict(model=model, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
                  temperature=0.9, max_tokens=16)
        a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
        b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
        c.check("seed reproduces", a == b, (a, b))
        s = chat_stream(client, seed=1234, **kw)[0]
        c.check("seed reproduces when streaming", s == a, (s, a))
        others = {client.chat.completions.create(seed=seed, **kw).choices[0].message.content for seed in (1, 2, 3)}
        others.add(a)
        c.check("different seeds sample differently", len(others) > 1, others)
        p = client.completions.create(model=model, prompt="My favourite food is", temperature=1.0, top_p=0.9,
                                      seed=-5, max_tokens=12).choices[0].text
        q = client.completions.create(model=model, prompt="My favourite food is", temperature=1.0, top_p=0.9,
                                      seed=-5, max_tokens=12).choices[0].text
        c.check("negative seed and top_p reproduce", p == q, (p, q))
        # Penalties (OpenAI's two, and vLLM's min_p and repetition_penalty as extra fields):
        # greedy, so any change comes from them, and reproducible, streaming or not.
        pk = dict(model=model, prompt="Say it again: red, red, red, red, red,", temperature=0, max_tokens=12)
        plain = client.completions.create(**pk).choices[0].text
        pen = dict(presence_penalty=1.5, frequency_penalty=1.0,
                   extra_body={"min_p": 0.05, "repetition_penalty": 1.3})
        x = client.completions.create(**pk, **pen).choices[0].text
        y = completion_stream(client, **pk, **pen)[0]
        c.check("penalties reproduce when streaming", x == y, (x, y))
        c.check("penalties change a repetitive text", x != plain, (x, plain))

    def logprobs():
        # Chat: one entry per generated token, each a log-probability with its 3 best
        # alternatives, sorted; greedy, so the chosen token is the best one. Asking for them
        # changes nothing else, and a stream carries the same entries chunk by chunk.
        kw = dict(model=model, messages=messages, temperature=0, max_tokens=12)
        plain = client.chat.completions.create(**kw).choices[0].message.content
        a = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
        ch = a.choices[0]
        content = ch.logprobs.content if ch.logprobs else []
        c.check("chat logprobs change nothing else", ch.message.content == plain, (ch.message.content, plain))
        c.check("chat logprobs: one per token", len(content) == a.usage.completion_tokens,
                (len(content), a.usage))
        c.check("chat logprobs are log-probabilities",
                content and all(e.logprob <= 0 and len(e.top_logprobs) == 3 for e in content), content)
        c.check("chat top_logprobs are sorted",
                all([t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
                    for e in content), content)
        c.check("greedy picks the best of top_logprobs",
                all(e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob
                    for e in content), content)
        streamed = []
        for chunk in client.chat.completions.create(stream=True, logprobs=True, top_logprobs=3, **kw):
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                streamed += chunk.choices[0].logprobs.content
        c.check("chat logprobs when streaming",
                [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content],
                (streamed, content))
        # Completions: the legacy parallel lists, whose tokens spell the text.
        b = client.completions.create(model=model, prompt="The three primary colours are", temperature=0,
                                      max_tokens=6, logprobs=2)
        lp = b.choices[0].logprobs
        c.check("completion logprobs: one per token",
                lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6, lp)
        c.check("completion logprobs spell the text", "".join(lp.tokens) == b.choices[0].text,
                (lp.tokens, b.choices[0].text))
        c.check("completion logprobs are log-probabilities",
                all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs), lp)
        offsets = [sum(len(t.encode()) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        c.check("completion text_offset", lp.text_offset == offsets, (lp.text_offset, offsets))

    def json_output():
        # JSON mode on real prompts asking for JSON: every answer parses as one object,
        # greedy or seeded, roomy or on a tight budget (the document is closed in time).
        asks = [
            "Give me a JSON object describing a cat with name and age.",
            "Return a JSON object with the keys city and country for Paris.",
            "List three fruits as JSON.",
            "Describe a book (title, author, year) in JSON.",
            "Make a JSON object for a user profile with an email address.",
            "Output the weather for today as JSON.",
            "Write a JSON object with a list of the first five prime numbers.",
            "Create a JSON recipe for pancakes with ingredients and steps.",
            "Give a JSON object mapping three colours to their hex codes.",
            "Return JSON describing a car: make, model, electric true or false.",
            "Summarise the planet Mars as a JSON object.",
            "Give me a JSON object with a nested address for a company.",
            "Provide a JSON object counting the vowels in the word banana.",
            "Encode a shopping list as JSON with quantities.",
            "Produce a JSON object describing a movie with a rating out of 10.",
            "Return a JSON object with a greeting in French, Spanish and German.",
            "Give JSON for a point in 3D space with negative and decimal coordinates.",
            "Make a JSON object of a to-do item with a done flag and null due date.",
            "Describe your favourite song as JSON, quotes in the title escaped.",
            "Write a JSON object of an HTTP response with status 404 and headers.",
        ]
        results = []
        for i, ask in enumerate(asks):
            kw = dict(model=model, messages=[{"role": "user", "content": ask}],
                      response_format={"type": "json_object"})
            with_budget(kw, i, tight=6, roomy=64)
            a = client.chat.completions.create(**kw)
            text = a.choices[0].message.content
            try:
                ok = isinstance(json.loads(text), dict)
            except ValueError:
                ok = False
            results.append((ok, ask, text, a.choices[0].finish_reason, a.usage.completion_tokens))
        c.check("json_object: every answer is one JSON object", all(r[0] for r in results),
                [r for r in results if not r[0]])
        c.check("json_object: a tight budget still closes the document",
                all(r[4] <= 6 for i, r in enumerate(results) if i % 4 == 3), results)
        texts["json"] = [r[2] for r in results]
        streamed = chat_stream(client, model=model, messages=[{"role": "user", "content": asks[0]}],
                               response_format={"type": "json_object"}, max_tokens=64, temperature=0)[0]
        c.check("json_object when streaming", streamed == results[0][2], (streamed, results[0][2]))

    def json_schema():
        # Schema mode on real prompts, each with its own schema: every answer validates
        # (checked by the jsonschema package), greedy or seeded, roomy or on a tight budget.
        s, i, n, b, arr = ({"type": "string"}, {"type": "integer"}, {"type": "number"},
                           {"type": "boolean"}, lambda it, **k: {"type": "array", "items": it, **k})

        def obj(props, required=None, **k):
            return {"type": "object", "properties": props,
                    "required": list(props) if required is None else required, **k}

        asks = [
            ("Give me a JSON object describing a cat with name and age.", obj({"name": s, "age": i})),
            ("Return the city and country of the Eiffel Tower as JSON.",
             obj({"city": s, "country": s}, additionalProperties=False)),
            ("List three fruits as JSON.", obj({"fruits": arr(s, minItems=3, maxItems=3)})),
            ("Describe a book (title, author, year) in JSON.", obj({"title": s, "author": s, "year": i})),
            ("Make a JSON user profile with an email address.",
             obj({"email": s, "verified": b, "age": {"type": ["integer", "null"]}}, ["email", "verified"])),
            ("Output the weather for today as JSON.",
             obj({"temperature": n, "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}})),
            ("Write the first five prime numbers as JSON.", obj({"primes": arr(i, minItems=5, maxItems=5)})),
            ("Create a JSON recipe for pancakes.",
             obj({"name": s, "ingredients": arr(obj({"item": s, "amount": s}), minItems=1),
                  "steps": arr(s)}, ["name", "ingredients"])),
            ("Give three colours with their hex codes as JSON.",
             arr(obj({"name": s, "hex": s}), minItems=3, maxItems=3)),
            ("Describe a car as JSON: make, model, electric or not.",
             obj({"make": s, "model": s, "electric": b})),
            ("Summarise the planet Mars as JSON.",
             obj({"name": {"const": "Mars"}, "moons": i, "habitable": b, "distance_km": n}, ["name", "moons"])),
            ("Give a company with a nested address as JSON.",
             obj({"name": s, "address": obj({"street": s, "city": s, "zip": s})})),
            ("Count the vowels in the word banana, as JSON.", obj({v: i for v in "aeiou"})),
            ("Encode a shopping list with quantities as JSON.",
             obj({"items": arr(obj({"name": s, "quantity": i}), minItems=2, maxItems=4)})),
            ("Describe a movie with a rating out of 10 as JSON.",
             obj({"title": s, "rating": n, "genres": arr({"enum": ["drama", "comedy", "action", "horror"]})},
                 ["title", "rating"])),
            ("Say hello in French, Spanish and German as JSON.", obj({"french": s, "spanish": s, "german": s})),
            ("Give a point in 3D space as JSON.", obj({"x": n, "y": n, "z": n})),
            ("Make a to-do item as JSON with a done flag and a due date or null.",
             obj({"task": s, "done": b, "due": {"type": ["string", "null"]}})),
            ("Describe your favourite song as JSON.",
             obj({"title": s, "artist": s, "tags": {"type": "object", "additionalProperties": s}}, ["title"])),
            ("Write an HTTP response with its status and headers as JSON.",
             obj({"status": {"enum": [200, 404, 500]}, "headers": {"type": "object", "additionalProperties": s}})),
        ]
        results = []
        for k, (ask, schema) in enumerate(asks):
            kw = dict(model=model, messages=[{"role": "user", "content": ask}],
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": f"answer_{k}", "schema": schema, "strict": True}})
            with_budget(kw, k, tight=64, roomy=128)
            a = client.chat.completions.create(**kw)
            text = a.choices[0].message.content
            try:
                jsonschema.Draft202012Validator(schema).validate(json.loads(text))
                ok = True
            except (ValueError, jsonschema.ValidationError) as e:
                ok = str(e)
            results.append((ok, ask, text, a.usage.completion_tokens, kw["max_tokens"]))
        c.check("json_schema: every answer validates", all(r[0] is True for r in results),
                [r for r in results if r[0] is not True])
        c.check("json_schema: within max_tokens", all(r[3] <= r[4] for r in results), results)
        texts["json_schema"] = [r[2] for r in results]
        ask, schema = asks[0]
        fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}}
        streamed = chat_stream(client, model=model, messages=[{"role": "user", "content": ask}],
                               response_format=fmt, max_tokens=128, temperature=0)[0]
        c.check("json_schema when streaming", streamed == results[0][2], (streamed, results[0][2]))
        try:
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=8,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "object", "anyOf": []}}})
            c.check("json_schema: what cannot be enforced is refused", False, "no error")
        except openai.BadRequestError as e:
            c.check("json_schema: what cannot be enforced is refused",
                    e.param == "response_format" and "anyOf" in str(e.body), e.body)
        try:
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": asks[7][1]}})
            c.check("json_schema: a budget too small for any document is refused", False, "no error")
        except openai.BadRequestError as e:
            c.check("json_schema: a budget too small for any document is refused",
                    e.param == "max_tokens" and "shortest" in str(e.body), e.body)

    def errors():
        try:
            client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=2)
            c.check("n=2 is refused", False, "no error")
        except openai.BadRequestError as e:
            c.check("n=2 is refused", e.status_code == 400 and e.param == "n", (e.status_code, e.body))
        try:
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
            c.check("unknown model is refused", False, "no error")
        except openai.NotFoundError as e:
            c.check("unknown model is refused", e.code == "model_not_found", e.body)
        try:
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=2,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
            c.check("tools are refused", False, "no error")
        except openai.BadRequestError as e:
            c.check("tools are refused", e.param == "tools", e.body)

    def client_goes_away():
        # Read a few chunks of a long stream, then hang up: the daemon must drop the
        # generation (the Rust side then checks that nothing stays active) and keep serving.
        stream = client.completions.create(model=model, prompt="Once upon a time", temperature=0,
                                           max_tokens=200, stream=True)
        got = 0
        for _ in stream:
            got += 1
            if got == 3:
                break
        stream.close()
        c.check("hang up mid-stream", got == 3, got)
        a = client.completions.create(model=model, prompt="Hello", temperature=0, max_tokens=2)
        c.check("serves after a hang-up", a.usage.completion_tokens >= 1, a.usage)

    for name, fn in [
        ("models", models),
        ("chat", chat),
        ("completions", completions),
        ("max_tokens", max_tokens),
        ("stop", stop_strings),
        ("seed", seeds),
        ("logprobs", logprobs),
        ("json_output", json_output),
        ("json_schema", json_schema),
        ("errors", errors),
        ("client goes away", client_goes_away),
    ]:
        c.section(name, fn)

    summary = {"ok": c.ok(), "openai_version": openai.__version__, "checks": c.results, "texts": texts}
    print(json.dumps(summary))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
