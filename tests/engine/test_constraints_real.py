"""Structured outputs on SmolLM2's real weights and byte-level BPE vocabulary: a JSON schema's
greedy answer is the same with n-gram and self-drafting as in plain decoding, and valid."""

from __future__ import annotations

import json

import pytest

from realmodels import MAX_MODEL_LEN, prompt_ids
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.constraints import Grammar
from verispec.engine.engine import Engine
from verispec.speculative.draft_model import DraftModelDrafter

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "languages", "year"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}}
PROMPT = ("Describe the Python programming language as JSON with its name, a list of languages that "
          "influenced it, and the year it first appeared.")


def test_smollm2_json_schema_greedy_identical_and_valid(smollm):
    params = SamplingParams(temperature=0.0, max_tokens=96, grammar=Grammar.json_schema(SCHEMA))
    ids = prompt_ids(smollm, PROMPT)
    plain = Engine(smollm, max_model_len=MAX_MODEL_LEN).generate(ids, params)
    ngram = Engine(smollm, SpeculativeConfig(method="ngram", num_speculative_tokens=5, adaptive=False),
                   max_model_len=MAX_MODEL_LEN).generate(ids, params)
    drafter = DraftModelDrafter(smollm, smollm.model.config.vocab_size, MAX_MODEL_LEN)
    self_draft = Engine(smollm, SpeculativeConfig(method="draft_model", num_speculative_tokens=4, adaptive=False),
                        max_model_len=MAX_MODEL_LEN, drafter=drafter).generate(ids, params)
    assert ngram.output_ids == plain.output_ids
    assert self_draft.output_ids == plain.output_ids
    assert plain.finish_reason == "stop"
    doc = json.loads(plain.text)
    assert set(doc) == {"name", "languages", "year"} and 1900 <= doc["year"] <= 2100
    # the unconstrained self-draft proposes what the grammar forbids (cut) and what it allows (accepted)
    assert self_draft.constraint.drafts_cut > 0 and self_draft.metrics.num_accepted_tokens > 0
