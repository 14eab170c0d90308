"""The two grammar backends behave alike behind tandem's ``Matcher`` interface, on the
embedded model's tokenizer: the tokens of a valid answer are each allowed by the bitmask
and accepted; a stop token is allowed exactly when the answer is complete and ends the
grammar; a disallowed token is refused without breaking the matcher; a bad constraint
raises ``GrammarCompileError`` with a one-line message."""
from __future__ import annotations

import pytest
import torch

from tandem.sampling_params import StructuredOutputsParams as S
from tandem.structured_output import GrammarCompileError, GrammarSpec, create_backend

pytestmark = pytest.mark.timeout(300)
BACKENDS = ["xgrammar", "guidance"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1,
                                                    "maxItems": 2}},
          "required": ["name", "n", "ok", "tags"], "additionalProperties": False}
# (No proper prefix of an answer is itself complete, so EOS must wait for its last token.)
VALID = [
    (S(json=SCHEMA), '{"name": "Bob", "n": -12, "ok": true, "tags": ["b", "a"]}'),
    (S(json_object=True), '{"x": [1, 2.5, null], "y": {"z": "w"}}'),
    (S(regex=r"\d{3}-[a-z]+;"), "123-abc;"),
    (S(choice=["yes", "no", 'say "hi"\n']), 'say "hi"\n'),
    (S(grammar='root ::= "The answer is " ("yes" | "no") "."'), "The answer is no."),
    (S(grammar='start: "ab" NUM "!"\nNUM: /[0-9]+/'), "ab42!"),
]


@pytest.fixture(scope="module")
def tokenizer(default_model_folder):
    from tandem.tokenizer import load_tokenizer

    return load_tokenizer(default_model_folder)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer):
    return create_backend(request.param, tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def allowed(matcher, vocab: int) -> torch.Tensor:
    bm = torch.full((2, -(-vocab // 32)), -1, dtype=torch.int32)
    bm[1] = 0  # row 1 must stay untouched: only the given row is filled
    matcher.fill_bitmask(bm, 0)
    assert (bm[1] == 0).all()
    bits = (bm[0].unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.reshape(-1)[:vocab].bool()


@pytest.mark.parametrize("so,text", VALID, ids=["json", "json_object", "regex", "choice", "ebnf", "lark"])
def test_valid_answer_is_allowed_token_by_token_and_ends_with_eos(backend, tokenizer, so, text):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    m = backend.compile(GrammarSpec.of(so)).new_matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    for i, t in enumerate(ids):
        mask = allowed(m, vocab)
        assert mask[t], f"token {i} ({tokenizer.decode([t])!r}) of {text!r} not allowed"
        assert not mask[eos], f"EOS allowed before the answer is complete (after {i} tokens)"
        assert not m.is_terminated and m.accept_token(t)
    assert allowed(m, vocab)[eos] and not m.is_terminated
    assert m.accept_token(eos) and m.is_terminated


def test_disallowed_token_is_refused_and_matcher_stays_usable(backend, tokenizer):
    m = backend.compile(GrammarSpec.of(S(regex=r"[0-9]+"))).new_matcher()
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    digit = tokenizer.encode("7", add_special_tokens=False)[0]
    assert not allowed(m, len(tokenizer))[letter]
    assert not m.accept_token(letter)
    assert m.accept_token(digit) and m.accept_token(tokenizer.eos_token_id) and m.is_terminated


def test_compiled_grammar_is_shared_matchers_are_not(backend, tokenizer):
    compiled = backend.compile(GrammarSpec.of(S(choice=["alpha", "beta"])))
    a, b = compiled.new_matcher(), compiled.new_matcher()
    for t in tokenizer.encode("alpha", add_special_tokens=False):
        assert a.accept_token(t)
    first_beta = tokenizer.encode("beta", add_special_tokens=False)[0]
    assert allowed(b, len(tokenizer))[first_beta] and not allowed(a, len(tokenizer))[first_beta]


@pytest.mark.parametrize("so,needle", [
    (S(json={"type": "objectx"}), "objectx"),
    (S(json={"type": "integer", "minimum": 5, "maximum": 1}), ""),
    (S(regex="(ab"), ""),
    (S(grammar='root ::= "a" | b'), "b"),
], ids=["unknown-type", "empty-range", "regex", "undefined-rule"])
def test_bad_constraint_raises_one_line(backend, so, needle):
    with pytest.raises(GrammarCompileError) as info:
        backend.compile(GrammarSpec.of(so))
    msg = str(info.value)
    assert "does not compile" in msg and "\n" not in msg and needle in msg


def test_tokens_past_the_tokenizer_are_never_allowed(tokenizer):
    """The model's vocabulary may be larger than the tokenizer's: the extra ids are masked."""
    vocab = len(tokenizer) + 40
    for name in BACKENDS:
        m = create_backend(name, tokenizer, vocab, [tokenizer.eos_token_id]).compile(
            GrammarSpec.of(S(json_object=True))).new_matcher()
        assert not allowed(m, vocab)[len(tokenizer):].any(), name


def test_step_fill_equals_row_by_row_fill(backend, tokenizer):
    """``fill_bitmasks`` (xgrammar's and llguidance's threads) writes exactly what filling
    each row alone writes, into the given rows only, for matchers in different states."""
    so, text = VALID[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    compiled = backend.compile(GrammarSpec.of(so))
    matchers = []
    for k in range(40):
        m = compiled.new_matcher()
        for t in ids[:k % len(ids)]:
            assert m.accept_token(t)
        matchers.append(m)
    words = -(-len(tokenizer) // 32)
    rows = [2 * k + 1 for k in range(len(matchers))]
    one = torch.full((2 * len(matchers) + 1, words), 7, dtype=torch.int32)
    for m, r in zip(matchers, rows):
        m.fill_bitmask(one, r)
    step = torch.full_like(one, 7)
    backend.fill_bitmasks(matchers, step, rows)
    assert torch.equal(one, step) and (step[0::2] == 7).all()


def test_step_accept_equals_token_by_token_accept(backend, tokenizer):
    """``accept_tokens`` (one native call with xgrammar) accepts and refuses exactly what
    each matcher's ``accept_token`` does, refusals leaving their matchers as they were, for
    batches with no refusal, one, and only refusals."""
    so, text = VALID[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    compiled = backend.compile(GrammarSpec.of(so))
    letter = tokenizer.encode("x", add_special_tokens=False)[0]

    def matchers_at(n: int) -> list:
        out = []
        for k in range(n):
            m = compiled.new_matcher()
            for t in ids[:k % (len(ids) - 1)]:
                assert m.accept_token(t)
            out.append(m)
        return out

    n = 24
    good = [ids[k % (len(ids) - 1)] for k in range(n)]
    for tokens in (good, [letter if k == 5 else t for k, t in enumerate(good)], [letter] * n):
        one, step = matchers_at(n), matchers_at(n)
        expected = [m.accept_token(t) for m, t in zip(one, tokens)]
        got = backend.accept_tokens(step, tokens)
        assert got == expected and all(type(x) is bool for x in got)
        vocab = len(tokenizer)
        assert all(torch.equal(allowed(a, vocab), allowed(b, vocab)) for a, b in zip(one, step))
    assert backend.accept_tokens(matchers_at(1), [letter]) == [False]


def test_draft_masks_cover_the_accepted_drafts_and_leave_the_matcher_as_it_was(backend, tokenizer):
    """Speculative decoding: row j is the mask after the first j drafts, up to the first draft
    the grammar refuses (the count returned); the matcher is where it started."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    m = backend.compile(GrammarSpec.of(S(regex=r"\d{3}-[a-z]+;"))).new_matcher()
    ids = tokenizer.encode("123-abc;", add_special_tokens=False)
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    words = -(-vocab // 32)
    drafts = ids[:2] + [letter] + ids[2:4]  # the third draft is refused: it and all after are cut
    bm = torch.full((1 + len(drafts), words), 0, dtype=torch.int32)
    assert m.draft_masks(drafts, bm, 0) == 2
    for j in range(3):
        ref = backend.compile(GrammarSpec.of(S(regex=r"\d{3}-[a-z]+;"))).new_matcher()
        for t in drafts[:j]:
            assert ref.accept_token(t)
        want = torch.full((1, words), -1, dtype=torch.int32)
        ref.fill_bitmask(want, 0)
        assert torch.equal(bm[j], want[0]), j
    assert (bm[3:] == 0).all()  # cut rows are left as they were
    for t in ids:  # the matcher itself never moved
        assert m.accept_token(t)
    assert m.accept_token(eos) and m.is_terminated
