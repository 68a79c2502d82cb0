"""The simulated engine: exact memory accounting on hand-worked cases, and whole traces."""
import pytest

from paxkv.sim import workloads as wl
from paxkv.sim.simulate import POLICIES, next_pow2, simulate


def _one(policy):
    # Prompt 10, output 5, blocks of 4: the five steps compute 10, 11, 12, 13, 14 tokens'
    # K/V (the fifth output token is never fed back), so 60 token-steps are stored.
    return simulate([wl.Request(10, 5)], policy=policy, block_size=4, pool_tokens=64,
                    max_model_len=32, watermark=0.0, record_series=True)


def test_paged_accounting_by_hand():
    r = _one("paged")
    assert r.steps == 5 and r.num_finished == 1 and r.output_tokens == 5
    assert r.series["stored"] == [10, 11, 12, 13, 14]
    assert r.series["held"] == [12, 12, 12, 16, 16]       # 3, 3, 3, 4, 4 blocks of 4
    assert r.all.stored == 60 and r.all.held == 68
    assert r.all.reserved == 2 + 1 + 0 + 1 + 0             # slots of the last block filled later
    assert r.all.wasted == 2 + 2                            # slots 15, 16 are never written
    assert r.utilization == pytest.approx(60 / 68)
    assert r.loaded.steps == 0                              # nothing ever waited


def test_reservation_accounting_by_hand():
    oracle = _one("reserve-oracle")                          # reserves prompt + output = 15
    assert oracle.series["held"] == [15] * 5
    assert oracle.all.reserved == 4 + 3 + 2 + 1 + 0 and oracle.all.wasted == 5
    assert oracle.utilization == pytest.approx(60 / 75)
    pow2 = _one("reserve-pow2")                              # next power of two of 15 = 16
    assert pow2.series["held"] == [16] * 5
    mx = _one("reserve-max")                                 # max_model_len = 32
    assert mx.series["held"] == [32] * 5 and mx.all.wasted == 5 * (32 - 14)
    static = _one("static")                                  # 8 blocks of 4 reserved up front
    assert static.series["held"] == [32] * 5


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 15, 16, 17, 2048)] == [1, 2, 4, 16, 16, 32, 2048]


@pytest.mark.parametrize("policy", POLICIES)
def test_whole_trace_finishes_every_request(policy):
    reqs = wl.sharegpt_like(40, seed=3)
    r = simulate(reqs, policy=policy, block_size=16, pool_tokens=4096, max_model_len=2048,
                 max_num_seqs=16)
    assert r.num_finished == 40
    assert r.output_tokens == sum(q.output_len for q in reqs)
    assert 0.0 < r.utilization <= 1.0
    assert r.all.stored + r.all.reserved + r.all.wasted == r.all.held


def test_paged_beats_reservation_under_load():
    reqs = wl.sharegpt_like(80, seed=4)
    kw = dict(pool_tokens=6144, max_model_len=2048, max_num_seqs=32)
    paged = simulate(reqs, policy="paged", block_size=16, **kw)
    oracle = simulate(reqs, policy="reserve-oracle", **kw)
    mx = simulate(reqs, policy="reserve-max", **kw)
    assert paged.loaded.steps > 0 and mx.loaded.steps > 0
    assert paged.loaded_utilization > 0.9 > oracle.loaded_utilization > mx.loaded_utilization
    assert paged.steps < oracle.steps < mx.steps     # bigger batches drain the trace sooner


def test_arrivals_idle_clock_and_bad_input():
    reqs = [wl.Request(8, 3, 0.0), wl.Request(8, 3, 100.0)]
    r = simulate(reqs, policy="paged", block_size=4, pool_tokens=64, max_model_len=32,
                 seconds_per_step=0.01)
    assert r.num_finished == 2 and r.steps == 6      # the engine idles until the second arrives
    with pytest.raises(ValueError, match="policy"):
        simulate(reqs, policy="lru", pool_tokens=64)
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([wl.Request(30, 5)], pool_tokens=64, max_model_len=32)
    with pytest.raises(ValueError, match="pool_tokens"):
        simulate(reqs, pool_tokens=0)


def test_pool_smaller_than_one_full_sequence_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([wl.Request(10, 5)], block_size=4, pool_tokens=16, max_model_len=32)
