"""The serving cache policy of the expert pool (moet_vllm.residency.policy)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moet_vllm.residency import Plan, ResidencyPolicy, key_ids, key_pairs, routed_keys
from moet_vllm.residency.policy import TokenTable, lowest


def consistent(pol: ResidencyPolicy) -> None:
    """slot_table and slot_keys describe the same one-to-one mapping."""
    table = pol.slot_table.ravel()
    res = np.flatnonzero(table >= 0)
    assert len(np.unique(table[res])) == len(res)
    assert np.array_equal(pol.slot_keys[table[res]], res)
    assert np.count_nonzero(pol.slot_keys >= 0) == len(res)


def test_keys_round_trip():
    layers, experts = np.array([0, 2, 3]), np.array([5, 0, 7])
    ids = key_ids(layers, experts, 8)
    assert ids.tolist() == [5, 16, 31]
    assert key_pairs(ids, 8).tolist() == [[0, 5], [2, 0], [3, 7]]
    topk = np.array([[[1, 2], [0, 3]], [[2, 1], [3, 3]]])  # [tokens 2, layers 2, top_k 2]
    assert routed_keys(topk, 4).tolist() == [1, 2, 4, 7, 2, 1, 7, 7]
    with pytest.raises(ValueError):
        routed_keys(topk[0], 4)


def test_plan_is_pure_commit_applies_and_stale_plans_are_refused():
    pol = ResidencyPolicy(4, 2, 4)
    plan = pol.plan([0, 5, 5])
    assert pol.resident.size == 0 and pol.version == 0  # nothing changed yet
    assert plan.fetch_keys.tolist() == [0, 5] and plan.fetch_slots.tolist() == [0, 1]
    assert plan.replay and plan.n_missing == 2 and plan.evict_keys.size == 0
    again = pol.plan([5, 0])
    assert np.array_equal(again.fetch_keys, plan.fetch_keys)
    pol.commit(plan)
    assert pol.slot_table[0, 0] == 0 and pol.slot_table[1, 1] == 1
    consistent(pol)
    with pytest.raises(ValueError, match="stale"):
        pol.commit(again)
    assert not pol.plan([0, 5]).replay  # resident now: no fetch, no replay


def test_promotion_takes_free_slots_then_only_colder_victims_hottest_first():
    """Reading in place: a read key enters over a colder unpinned key, hottest first, at most
    `max_rows` of them; a key no hotter than its victim stays read in place."""
    pol = ResidencyPolicy(3, 1, 16, half_life_steps=math.inf)  # no decay: exact counts
    pol.observe([0, 0, 0, 1, 1, 2])  # scores 0:3, 1:2, 2:1
    plan = pol.plan_promotion([0, 1], max_rows=8)
    assert plan.fetch_keys.tolist() == [0, 1] and plan.evict_keys.size == 0  # free slots
    pol.commit(plan)
    pol.observe([5] * 4 + [6] * 2 + [7])  # 5:4, 6:2, 7:1 read in place
    plan = pol.plan_promotion([5, 6, 7], max_rows=8)
    # the free slot goes to 5 (hottest); 6 (2) ties key 1 (2), the colder victim: no swap
    assert plan.fetch_keys.tolist() == [5] and plan.evict_keys.size == 0
    pol.commit(plan)
    pol.observe([6] * 3)  # 6: 5 now, hotter than 1 (2) and than 0 (3)
    plan = pol.plan_promotion([6, 7, 0], max_rows=8)  # 0 is routed: pinned
    assert plan.fetch_keys.tolist() == [6] and plan.evict_keys.tolist() == [1]
    assert plan.fetch_slots.tolist() == [int(pol.slot_table.ravel()[1])]
    assert pol.plan_promotion([6, 7], max_rows=0).fetch_keys.size == 0  # the cap
    pol.commit(plan)
    consistent(pol)
    assert pol.plan_promotion([0, 5, 6], max_rows=8).fetch_keys.size == 0  # all resident


def test_decay_constant_is_a_half_life():
    pol = ResidencyPolicy(8, 1, 8, half_life_steps=4)
    pol.observe([3, 3])  # two tokens routed expert 3
    assert pol.score[3] == pytest.approx(2.0)
    for _ in range(4):
        pol.observe([])
    assert pol.score[3] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ResidencyPolicy(8, 1, 8, half_life_steps=0)


def test_victims_are_the_lowest_decayed_frequency_then_lru_then_id():
    pol = ResidencyPolicy(4, 1, 16, half_life_steps=math.inf)  # no decay: exact ties
    for keys in ([0, 1, 2, 3], [0, 1], [0, 2], [0]):  # counts: 0:4, 1:2, 2:2, 3:1
        pol.step(keys)
    plan = pol.step([0, 9])  # one victim among 1, 2, 3: key 3 has the fewest routings
    assert plan.evict_keys.tolist() == [3] and plan.fetch_keys.tolist() == [9]
    # 1 and 2 now tie at 2 routings; 2 was routed more recently, so 1 goes
    plan = pol.step([0, 9, 10])
    assert plan.evict_keys.tolist() == [1]
    consistent(pol)
    # exact ties in score and recency go to the lowest key id
    pol = ResidencyPolicy(2, 1, 8)
    pol.step([5, 4])
    assert pol.step([7]).evict_keys.tolist() == [4]


def test_recent_routings_outweigh_old_ones():
    def victim(half_life):
        pol = ResidencyPolicy(2, 1, 8, half_life_steps=half_life)
        for keys in ([1], [1], [1], [], [], [], [], [], [], [2], [2]):
            pol.step(keys)
        return pol.step([3]).evict_keys.tolist()

    assert victim(2.0) == [1]  # three old routings weigh less than two recent ones
    assert victim(math.inf) == [2]  # LFU counts them all


@settings(max_examples=60, deadline=None)
@given(
    n_slots=st.integers(4, 12),
    seq=st.lists(
        st.tuples(
            st.lists(st.integers(0, 23), min_size=1, max_size=4),
            st.lists(st.integers(0, 23), max_size=6),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_pins_are_never_evicted_and_routed_keys_end_resident(n_slots, seq):
    pol = ResidencyPolicy(n_slots, 3, 8, protected_fraction=0.5)
    for decode, scan in seq:
        scan_arr = np.array(scan, dtype=np.int64)
        plan = pol.plan(decode, scan=scan_arr)
        evicted = set(plan.evict_keys.tolist())
        assert not set(decode) & evicted
        # a scan key of the step is evicted only when decode needs its slot: it is then unplaced
        bumped = set(scan) & evicted
        assert bumped <= set(plan.unplaced_keys.tolist())
        assert not bumped or len(set(decode) | set(scan)) > n_slots
        assert set(plan.unplaced_keys.tolist()) <= set(scan) - set(decode)
        pol.commit(plan, scan=scan_arr)
        pol.observe(decode)
        consistent(pol)
        table = pol.slot_table.ravel()
        assert np.all(table[decode] >= 0)  # every decode key is resident for the replay
        placed = set(scan) - set(plan.unplaced_keys.tolist())
        assert np.all(table[sorted(placed)] >= 0)
        assert len(pol.resident) <= n_slots


def test_decode_takes_the_slots_of_its_own_scan_keys_last():
    pol = ResidencyPolicy(4, 1, 8)
    pol.step([0], scan=np.array([1, 2]))  # 0, 1, 2 resident
    plan = pol.plan([0, 3, 4], scan=np.array([1, 2]))  # 5 keys, 4 slots
    assert plan.fetch_keys.tolist() == [3, 4]
    assert len(plan.evict_keys) == 1 and plan.evict_keys[0] in (1, 2)
    assert plan.unplaced_keys.tolist() == plan.evict_keys.tolist()
    pol.commit(plan)
    consistent(pol)


def test_a_step_wider_than_the_pool_is_refused():
    pol = ResidencyPolicy(3, 1, 8)
    with pytest.raises(ValueError, match="3 slots"):
        pol.plan([0, 1, 2, 3])
    with pytest.raises(ValueError):
        pol.plan([8])  # not a key of this geometry


def warm_policy():
    """A full pool of 10 slots after decode steps: key k routed in the first 40 - 3k steps."""
    pol = ResidencyPolicy(10, 4, 16, half_life_steps=64, protected_fraction=0.8)
    for t in range(40):
        pol.step([k for k in range(10) if t < 40 - 3 * k])
    assert sorted(pol.resident.tolist()) == list(range(10))
    return pol


def test_a_scan_never_evicts_the_decode_hot_set():
    pol = warm_policy()
    hot = pol.hot_set()
    assert len(hot) == 8 and set(hot.tolist()) == set(range(8))  # the 8 most routed
    scores = pol.score.copy()
    cold = np.arange(20, 40)  # a prefill chunk of 20 keys never routed by decode
    plan = pol.plan([], scan=cold)
    assert not set(plan.evict_keys.tolist()) & set(hot.tolist())
    assert sorted(plan.evict_keys.tolist()) == [8, 9]  # only the probation keys go
    assert len(plan.fetch_keys) == 2 and len(plan.unplaced_keys) == 18
    pol.commit(plan, scan=cold)
    pol.observe([])
    assert set(hot.tolist()) <= set(pol.resident.tolist())
    assert np.allclose(pol.score, scores * pol.decay)  # a scan does not raise frequencies
    # the next chunk takes the previous chunk's slots, still not the hot set
    plan = pol.plan([], scan=np.arange(40, 50))
    assert set(plan.evict_keys.tolist()) == set(pol.resident.tolist()) - set(hot.tolist())
    # a decode step may evict anything unpinned, coldest first
    pol.commit(plan, scan=np.arange(40, 50))
    plan = pol.plan([60, 61])
    assert len(plan.evict_keys) == 2 and not set(plan.evict_keys.tolist()) & set(hot.tolist())


def test_a_scan_fills_free_slots_without_evicting():
    pol = ResidencyPolicy(10, 2, 16)
    pol.step([0, 1, 2])
    plan = pol.plan([0], scan=np.arange(16, 32))  # 16 keys, 7 free slots
    assert plan.evict_keys.size == 0
    assert plan.fetch_slots.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert plan.fetch_keys.tolist() == list(range(16, 23))
    assert plan.unplaced_keys.tolist() == list(range(23, 32))


def test_plans_are_deterministic():
    rng = np.random.default_rng(7)
    seq = [rng.integers(0, 64, size=6) for _ in range(200)]
    plans = []
    for order in (False, True):
        pol = ResidencyPolicy(12, 4, 16)
        got = []
        for keys in seq:
            keys = rng.permutation(keys) if order else keys  # input order does not matter
            p = pol.step(keys)
            got.append((p.fetch_keys.tolist(), p.fetch_slots.tolist(), p.evict_keys.tolist()))
        plans.append((got, pol.slot_table.copy()))
    assert plans[0][0] == plans[1][0]
    assert np.array_equal(plans[0][1], plans[1][1])
    assert sum(len(f) for f, _, _ in plans[0][0]) > 12  # it did evict and fetch


def test_warm_start_preloads_hottest_first_and_evicts_coldest_first():
    pol = ResidencyPolicy(4, 1, 16)
    plan = pol.plan_preload([7, 3, 3, 9, 1, 5])  # hottest first; beyond 4 slots skipped
    assert isinstance(plan, Plan) and plan.preload
    assert plan.fetch_keys.tolist() == [7, 3, 9, 1] and plan.fetch_slots.tolist() == [0, 1, 2, 3]
    pol.commit(plan)
    assert pol.step([7, 11]).evict_keys.tolist() == [1]  # the coldest preloaded key
    assert pol.step([7, 12]).evict_keys.tolist() == [9]
    pol.step([3, 7])
    assert pol.hot_keys(2).tolist() == [7, 3]  # what a warm start persists, hottest first


def test_lowest_orders_and_ties():
    cands = np.arange(8)
    a = np.array([3, 1, 1, 0, 2, 1, 5, 0])
    b = np.array([0, 9, 2, 1, 0, 2, 0, 0])
    assert lowest(cands, 3, a).tolist() == [3, 7, 1]
    assert lowest(cands, 4, a, b).tolist() == [7, 3, 2, 5]
    assert lowest(cands, 20, a, b).tolist() == [7, 3, 2, 5, 1, 4, 0, 6]
    assert lowest(cands, 0, a).size == 0


# -- the token predictor ------------------------------------------------------------------------


def test_token_table_counts_what_each_token_routed():
    t = TokenTable(8)
    t.learn([3, 3, 5, 3], [[0, 1], [0, 2], [6, 7], [0, 1]])  # token 3: 0 x3, 1 x2, 2 x1
    keys, prob = t.predict([3], 0.5)
    assert keys.tolist() == [0, 1] and prob.tolist() == pytest.approx([1.0, 2 / 3])
    assert t.predict([3], 0.3)[0].tolist() == [0, 1, 2]
    # several tokens: a key's share is its highest over them; most likely first, then by id
    assert t.predict([5, 3], 0.5)[0].tolist() == [0, 6, 7, 1]
    assert t.predict([4], 0.01)[0].size == 0  # never seen: nothing predicted
    assert t.predict([3], 0.0)[0].size == 0  # threshold 0: prediction off
    with pytest.raises(ValueError):
        t.learn([-1], [[0]])


def test_token_table_rows_change_hands_only_when_worn_down():
    t = TokenTable(4, max_bytes=2 * 2 * 4)  # 2 rows: tokens 1 and 3 share row 1
    assert t.rows == 2
    for _ in range(3):
        t.learn([1], [[2]])
    t.learn([3, 3], [[0], [0]])  # two occurrences wear token 1 down to 1: it keeps its row
    assert t.predict([1], 0.5)[0].tolist() == [2] and t.predict([3], 0.01)[0].size == 0
    t.learn([3], [[0]])  # the last one: token 3 takes the row, with its own counts only
    assert t.predict([1], 0.01)[0].size == 0
    assert t.predict([3], 0.5)[0].tolist() == [0] and int(t.seen[1]) == 1


def test_token_table_halves_before_a_count_overflows():
    t = TokenTable(4)
    t.learn(np.zeros(0xFFFE, np.int64), np.zeros((0xFFFE, 1), np.int64))  # key 0, 65534 times
    t.learn([0, 0], [[0], [1]])
    assert int(t.seen[0]) == 0xFFFE // 2 + 2 and int(t.counts[0, 0]) == 0xFFFE // 2 + 1
    keys, prob = t.predict([0], 1e-5)
    assert keys.tolist() == [0, 1] and prob[0] == pytest.approx(1.0, abs=1e-4)


def test_plan_ahead_fetches_the_predicted_keys_and_is_no_replay():
    pol = ResidencyPolicy(4, 2, 4, predict_threshold=0.5)
    pol.step([0, 1, 2, 3])
    pol.learn([7, 7], [[4, 5], [4, 6]])  # token 7 routed 4 twice, 5 and 6 once each
    plan = pol.plan_ahead([7])
    assert pol.resident.tolist() == [0, 1, 2, 3]  # pure
    assert plan.fetch_keys.tolist() == [4, 5, 6] and plan.n_prefetch == 3
    assert not plan.replay and plan.n_missing == 0
    assert len(plan.evict_keys) == 3  # the coldest three of 0..3
    pol.commit(plan)
    assert {4, 5, 6} <= set(pol.resident.tolist())
    # resident predicted keys are pinned: never the victims of the predicted fetch
    pol = ResidencyPolicy(3, 1, 8, predict_threshold=0.5)
    pol.step([0])
    pol.step([1])
    pol.step([2])  # 0 is the coldest
    pol.learn([9], [[0, 5]])
    plan = pol.plan_ahead([9])
    assert plan.fetch_keys.tolist() == [5] and plan.evict_keys.tolist() == [1]
    # off, or nothing known: an empty plan
    off = ResidencyPolicy(3, 1, 8, predict_threshold=0.0)
    off.learn([9], [[5]])
    assert not off.predicts and off.plan_ahead([9]).fetch_keys.size == 0
    assert pol.plan_ahead([4]).fetch_keys.size == 0
    with pytest.raises(ValueError):
        ResidencyPolicy(3, 1, 8, predict_threshold=1.5)
    with pytest.raises(ValueError):
        pol.learn([9], [[8]])  # not a key of this geometry
