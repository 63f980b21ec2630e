"""A pool grown for good gives back what admission shortened to fit the smaller one.

Admission shortens a request's max_tokens to the longest answer that fits the configured KV
pool (README "Admission control": `truncated: true`). When a reload grows `kv_cache_bytes`
while the request runs, it gets its own max_tokens back, as far as the larger pool holds it
and the other commitments leave room beside it, and its peak is re-reserved for the longer
answer; it ends not truncated where it got all of it. Through the real engine on the tiny
model."""

from __future__ import annotations

from kvguard.engine.admission import AdmissionConfig
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.sequence import RequestOutput
from tests.test_engine import make_engine
from tests.test_kv_pool import apply
from tests.test_remedies import greedy

PROMPT = list(range(3, 22))  # 19 tokens
ASKED = 450
LOW = 2
KIB = 1024


def run_out(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until every request has finished: the final output of each."""
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        engine.audit_blocks()
    return done


def committed_fresh(kv_cache_bytes: int) -> int:
    """The blocks admission commits for the low request on an idle engine of this pool."""
    fresh = make_engine(
        kv_cache_bytes=kv_cache_bytes, max_model_len=512, admission=AdmissionConfig()
    )
    fresh.add_request(PROMPT, greedy(ASKED), priority="low")
    return fresh.admission.committed_blocks


def low_request(engine: LLMEngine) -> str:
    """A low request of ASKED tokens that a 32-block pool's admission shortens, started."""
    rid = engine.add_request(PROMPT, greedy(ASKED), priority="low")
    engine.step()
    seq = engine._seqs[rid]
    assert seq.max_tokens < ASKED, "the test needs admission to shorten the request"
    assert seq.num_computed_tokens > 0, "the test needs the request running"
    return rid


def test_a_reload_that_grows_the_pool_gives_a_shortened_request_its_max_tokens_back() -> None:
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=512, admission=AdmissionConfig())
    assert engine.block_manager.num_blocks == 32
    rid = low_request(engine)
    ctl = engine.admission
    res = apply(engine, engine.reconfigure({("kv_cache_bytes",): 8 * KIB * KIB}))
    assert res.ok and res.after["kv_pool_blocks"] == 1024, res.detail
    assert engine._seqs[rid].max_tokens == ASKED
    # its peak is re-reserved for the whole answer, as admission would reserve it now
    assert ctl.committed_blocks == committed_fresh(8 * KIB * KIB)
    out = run_out(engine)[rid]
    assert out.num_output_tokens == ASKED and out.finish_reason == "length"
    assert not out.truncated
    assert ctl.committed_blocks == 0


def test_a_pool_grown_a_little_gives_back_only_what_fits_it() -> None:
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=512, admission=AdmissionConfig())
    rid = low_request(engine)
    before = engine._seqs[rid].max_tokens
    ctl = engine.admission
    res = apply(engine, engine.reconfigure({("kv_cache_bytes",): 264 * KIB}))  # 33 blocks
    assert res.ok and res.after["kv_pool_blocks"] == 33, res.detail
    fits = ctl.longest_answer(len(PROMPT), ctl.limit_blocks(33, LOW))
    assert before < fits < ASKED
    assert engine._seqs[rid].max_tokens == fits
    assert ctl.committed_blocks == committed_fresh(264 * KIB)
    out = run_out(engine)[rid]
    assert out.num_output_tokens == fits and out.truncated


def test_a_grown_pool_gives_back_no_more_than_the_commitments_beside_it_leave() -> None:
    """Worst-case admission commits each admitted request's whole peak: the shortened request
    grows only by what the budget holds beside a high request admitted into the reserve."""
    engine = make_engine(
        kv_cache_bytes="256KiB",
        max_model_len=512,
        admission=AdmissionConfig(estimate="worst_case"),
        enable_prefix_caching=False,  # each request's whole peak its own: the sums are exact
    )
    ctl = engine.admission
    rid = low_request(engine)
    high = engine.add_request(list(range(40, 59)), greedy(20), priority="high")
    engine.step()
    assert engine.admission_policy.is_admitted(engine._seqs[high])
    beside = ctl.projected_blocks(19, 20)
    assert ctl.committed_blocks == beside + ctl.projected_blocks(19, engine._seqs[rid].max_tokens)
    res = apply(engine, engine.reconfigure({("kv_cache_bytes",): 304 * KIB}))  # 38 blocks
    assert res.ok and res.after["kv_pool_blocks"] == 38, res.detail
    limit = ctl.limit_blocks(38, LOW)
    # the larger pool alone would hold the whole answer; beside the high request it does not
    assert ctl.longest_answer(len(PROMPT), limit) >= ASKED
    got = engine._seqs[rid].max_tokens
    assert got < ASKED
    assert ctl.projected_blocks(len(PROMPT), got) == limit - beside
    assert ctl.committed_blocks == limit
    done = run_out(engine)
    assert done[rid].num_output_tokens == got and done[rid].truncated
    assert done[high].num_output_tokens == 20
    assert ctl.committed_blocks == 0


def test_a_narrower_kv_dtype_grows_the_pool_and_gives_the_max_tokens_back() -> None:
    """The same bytes in fp8 hold more blocks: a switch grows the pool for good, as a reload."""
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=512, admission=AdmissionConfig())
    rid = low_request(engine)
    res = apply(engine, engine.set_kv_cache_dtype("fp8_e4m3"))
    assert res.ok and res.after["kv_pool_blocks"] > 2 * 32, res.detail
    assert engine._seqs[rid].max_tokens == ASKED
    out = run_out(engine)[rid]
    assert out.num_output_tokens == ASKED and not out.truncated
    assert engine.admission.committed_blocks == 0
