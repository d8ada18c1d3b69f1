"""`tandem serve` with its prefix cache through the official `openai` client, on the real default model: a prompt
that begins with an earlier prompt's document, or a conversation's next turn, reports the tokens it took from the
kept prefix in its usage, as OpenAI reports prompt caching, and answers as the same prompt prefilled cold
(`"prefix_cache": false`)."""

import openai
import pytest

from tandem.cache.prefix import PrefixCache
from tandem.config import TandemConfig
from tandem.serve.scheduler import Limits
from tests.serve import live

pytestmark = pytest.mark.model

CONFIG = TandemConfig(policy="quest", sink_tokens=8, window_tokens=32)


def test_a_shared_document_is_prefilled_once_and_answers_as_cold(smollm, prose):
    model, tok = smollm
    server = live.build(model, tok, CONFIG, Limits(max_batch=2, prefill_chunk=16), prefix=PrefixCache())
    document = tok.decode(tok(prose).input_ids[:120])
    with live.running(server) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

        def ask(question, **body):
            return client.completions.create(
                model=live.NAME, prompt=f"{document}\nQ: {question}\nA:", max_tokens=8, temperature=0,
                extra_body=body,
            )  # fmt: skip

        first = ask("Who is it about?")
        warm = ask("Where does it happen?")
        cold = ask("Where does it happen?", prefix_cache=False)
        metrics = live.metrics(base)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= 96 and cached % 16 == 0 and cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].text == cold.choices[0].text
    assert metrics["tandem_prefix_hits_total"] == 1 and metrics["tandem_prefix_hit_tokens_total"] == cached
    assert metrics["tandem_prefix_lookups_total"] == 2 and metrics["tandem_prefix_bytes"] > 0
    # the first request had ended: the second took its host rows over
    assert metrics["tandem_prefix_taken_over_total"] == 1


def test_a_conversations_next_turn_starts_from_its_earlier_turns(smollm, prose):
    model, tok = smollm
    server = live.build(model, tok, CONFIG, Limits(max_batch=2, prefill_chunk=16), prefix=PrefixCache())
    messages = [{"role": "user", "content": tok.decode(tok(prose).input_ids[:120]) + "\nWho is it about?"}]
    with live.running(server) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

        def chat(messages, **body):
            return client.chat.completions.create(
                model=live.NAME, messages=messages, max_tokens=8, temperature=0, extra_body=body
            )

        first = chat(messages)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Say it again in other words."},
        ]
        warm, cold = chat(messages), chat(messages, prefix_cache=False)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert (
        cached >= first.usage.prompt_tokens - 2 * 16 and cached % 16 == 0
    )  # the first turn's last boundaries
    assert warm.choices[0].message.content == cold.choices[0].message.content
