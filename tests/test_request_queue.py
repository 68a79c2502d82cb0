"""The scheduling policy as a queue object: FCFS and priority order admission, and the
policy's key orders the running batch and the choice of what to preempt."""
from __future__ import annotations

import pytest

from engine_helpers import make_block_manager
from paxkv.config import SchedulerConfig
from paxkv.engine.request_queue import (FCFSRequestQueue, PriorityRequestQueue, SchedulingPolicy,
                                        create_request_queue)
from paxkv.engine.scheduler import Scheduler
from paxkv.engine.sequence import Sequence, SequenceStatus


def seq(seq_id: int, arrival: float, priority: int = 0, n_tokens: int = 8) -> Sequence:
    s = Sequence(seq_id, f"r{seq_id}", list(range(3, 3 + n_tokens)), None, arrival)
    s.priority = priority
    return s


def test_queues_order_and_remove():
    a, b, c = seq(0, 0.0, 5), seq(1, 1.0, 0), seq(2, 2.0, 5)
    for queue, want in ((FCFSRequestQueue(), [a, b, c]), (PriorityRequestQueue(), [b, a, c])):
        for order, s in enumerate((a, b, c)):
            queue.add(s, queue.key(s, order))
        assert list(queue) == want and queue.peek() is want[0] and len(queue) == 3
        assert queue.remove(c) and not queue.remove(c)
        first = queue.pop()
        queue.prepend([first], [queue.key(first, 0 if first is a else 1)])
        assert queue.peek() is first
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    assert create_request_queue(SchedulingPolicy.FCFS).key(a, 7) == (0.0, 7, 0)
    with pytest.raises(ValueError, match="scheduling_policy"):
        create_request_queue("lifo")


def make_sched(policy: str, num_blocks: int = 64, max_num_seqs: int = 1) -> Scheduler:
    bm = make_block_manager(num_blocks, 4, watermark=0.0)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                     max_model_len=64, scheduling_policy=policy), bm.cache, bm)


@pytest.mark.parametrize("policy,want", [("fcfs", [0, 1, 2]), ("priority", [1, 0, 2])])
def test_admission_follows_the_policy(policy, want):
    sched = make_sched(policy)
    for s in (seq(0, 0.0, 5), seq(1, 1.0, 0), seq(2, 2.0, 5)):
        sched.add_seq(s)
    admitted = []
    while sched.has_unfinished():
        out = sched.schedule()
        sched.on_step_done(out)
        for c in out.chunks:
            admitted.append(c.seq.seq_id)
            sched.finish(c.seq, SequenceStatus.FINISHED_LENGTH)
    assert admitted == want


def test_priority_preempts_the_lowest_priority_first():
    """Two sequences grow in a pool that holds one: the one of larger `priority` value is
    preempted even though it arrived first."""
    sched = make_sched("priority", num_blocks=12, max_num_seqs=2)
    low, high = seq(0, 0.0, priority=9, n_tokens=20), seq(1, 1.0, priority=0, n_tokens=20)
    sched.add_seq(low)
    sched.add_seq(high)
    preempted = []
    for _ in range(40):
        out = sched.schedule()
        sched.on_step_done(out)
        preempted += [p.seq_id for p in out.preempted]
        for c in out.chunks:
            if c.needs_sample:
                c.seq.append_token(5)
        if preempted:
            break
    assert preempted and set(preempted) == {0}
    assert sched.priority(high) < sched.priority(low)


def test_llm_generate_takes_priorities():
    from paxkv import LLM, SamplingParams
    llm = LLM("tiny", dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              max_num_seqs=1, scheduling_policy="priority")
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    outs = llm.generate(["Emma", "It is a truth"], sp, use_tqdm=False, priority=[3, 0])
    firsts = sorted(outs, key=lambda o: o.metrics.first_token_time)
    assert [o.prompt for o in firsts] == ["It is a truth", "Emma"]
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["Emma"], sp, use_tqdm=False, priority=[1, 2])
    with pytest.raises(TypeError, match="priority"):
        llm.generate(["Emma"], sp, use_tqdm=False, priority=[1.5])
