"""RolloutProducer with a fake engine (no model): the staleness of each batch is the queue depth
reached, never more than max_staleness; no batch is generated across a weight sync; depth 0 is
the synchronous order of calls; an engine error reaches the trainer's thread; with partial
rollouts a sync goes out while a batch is generated, and the overlap is counted."""

import threading
import time

import pytest
import torch

from grouprl.rollout import Rollout
from grouprl.rollout.producer import RolloutCancelled, RolloutProducer


class FakeEngine:
    """Holds a weights version; `generate` records the version at its start and at its end."""

    decodes_with_policy = False

    def __init__(self, fail_at: int | None = None):
        self.version, self.log, self.fail_at = 0, [], fail_at
        self.threads: set[str] = set()

    def sync_weights(self, model, version):
        self.log.append(("sync", version))
        self.version = version

    def generate(self, prompt: int) -> Rollout:
        self.threads.add(threading.current_thread().name)
        start = self.version
        if prompt == self.fail_at:
            raise ConnectionError("server gone")
        time.sleep(0.01)  # long enough for a sync to slip in, were it allowed to
        self.log.append(("generate", prompt, start, self.version))
        one = torch.zeros((1, 1), dtype=torch.long)
        return Rollout(one, one, one, one.bool(), torch.zeros(1, dtype=torch.bool))

    def close(self):
        pass


class HoldsBatch1:
    """A producer's `generate` over `engine` that records each batch's weights version at its start and
    end (`versions`), and holds batch 1 mid-generation (`generating` set) until the test sets `go_on`."""

    def __init__(self, engine: FakeEngine):
        self.engine, self.versions = engine, {}
        self.generating, self.go_on = threading.Event(), threading.Event()

    def __call__(self, prompt: int) -> Rollout:
        start = self.engine.version
        if prompt == 1:
            self.generating.set()
            assert self.go_on.wait(timeout=120), "the test never let batch 1 go on"
        self.versions[prompt] = (start, self.engine.version)
        return self.engine.generate(prompt)


def train(depth: int, steps: int, engine: FakeEngine | None = None) -> tuple[list[int], FakeEngine]:
    engine = engine or FakeEngine()
    counter = iter(range(1000))
    producer = RolloutProducer(engine, lambda: next(counter), engine.generate, max_staleness=depth)
    staleness = []
    for step in range(1, steps + 1):
        produced = producer.next()
        staleness.append(produced.staleness)
        assert produced.synced == engine.log[[e[:2] for e in engine.log].index(("generate", produced.prompts))][2]
        producer.sync_weights(None, step)  # the update of this step
    producer.close()
    return staleness, engine


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_staleness_ramps_to_the_depth_and_stays_there(depth):
    staleness, engine = train(depth, steps=8)
    assert staleness == [min(step, depth) for step in range(8)]
    generated = [e for e in engine.log if e[0] == "generate"]
    assert all(start == end for _, _, start, end in generated)  # one version per batch, never a mix
    assert [p for _, p, _, _ in generated] == list(range(len(generated)))  # prompts in order


def test_depth_0_generates_in_the_callers_thread_in_step_order():
    _, engine = train(0, steps=3)
    assert engine.threads == {threading.current_thread().name}
    assert engine.log == [("generate", 0, 0, 0), ("sync", 1), ("generate", 1, 1, 1), ("sync", 2),
                          ("generate", 2, 2, 2), ("sync", 3)]


def test_an_engine_error_in_the_background_reaches_the_trainer():
    with pytest.raises(ConnectionError, match="server gone"):
        train(1, steps=5, engine=FakeEngine(fail_at=2))


def test_partial_rollouts_send_without_waiting_and_count_the_overlap():
    """partial: the sync goes out while the batch is generated (its start and end versions differ),
    `overlapped` says so, staleness is the queue's as before, and the step's tally reports the share;
    without partial, the sync waits for the batch: one version per batch and no overlap. No timing
    decides it: batch 1 is held mid-generation until the test lets it go on, after the sync has
    returned (partial) or while the sync is still waiting for it (not partial)."""
    from grouprl.sample_stats import SampleTally

    for partial in (True, False):
        engine = FakeEngine()
        generate = HoldsBatch1(engine)
        versions, generating, go_on = generate.versions, generate.generating, generate.go_on
        counter = iter(range(10))
        producer = RolloutProducer(engine, lambda: next(counter), generate, max_staleness=1, partial=partial)
        first = producer.next()  # batch 0; batch 1 starts in the background
        assert generating.wait(timeout=60)  # batch 1 has read its start version and is held there
        sync = threading.Thread(target=producer.sync_weights, args=(None, 1))
        sync.start()
        if partial:
            sync.join(timeout=60)  # returns at once; the timeout only turns a hang into a failure
            assert not sync.is_alive(), "partial: sync_weights waited for the batch being generated"
        else:
            sync.join(timeout=0.5)  # the time a sync that did not wait would have to slip in
            assert sync.is_alive(), "sync_weights did not wait for the batch being generated"
        go_on.set()
        sync.join(timeout=60)
        assert not sync.is_alive()
        second = producer.next()
        producer.close()
        start, end = versions[1]
        assert (first.overlapped, second.staleness) == (0, 1)
        assert (second.overlapped, start, end) == ((1, 0, 1) if partial else (0, 0, 0))  # else: sync waited

    tally = SampleTally()
    tally.add_round(8, 1, {}, 0, 2, overlapped=1)
    tally.add_round(24, 0, {}, 0, 6, overlapped=0)
    assert tally.metrics({}, False, partial=True)["rollout/partial_frac"] == 8 / 32
    assert "rollout/partial_frac" not in tally.metrics({}, False)


def test_partial_rollouts_count_a_batch_queued_during_a_sync_from_the_version_it_starts_on():
    """partial, max_staleness 2: batch 2 waits in the queue behind batch 1 while a sync goes out, so
    it is sampled wholly from the new weights: no overlap, and its staleness counts from the new
    version (batch 1, held mid-generation across the sync, overlaps it)."""
    engine = FakeEngine()
    generate = HoldsBatch1(engine)
    versions, generating, go_on = generate.versions, generate.generating, generate.go_on
    counter = iter(range(10))
    producer = RolloutProducer(engine, lambda: next(counter), generate, max_staleness=2, partial=True)
    producer.next()  # batch 0; batch 1 starts in the background, batch 2 waits behind it
    assert generating.wait(timeout=60)
    producer.sync_weights(None, 1)  # partial: at once, while batch 1 is held and batch 2 queued
    go_on.set()
    first, second = producer.next(), producer.next()
    producer.close()
    assert versions[1] == (0, 1) and versions[2] == (1, 1)
    assert (first.overlapped, first.staleness) == (1, 1)
    assert (second.overlapped, second.staleness, second.synced) == (0, 0, 1)


@pytest.mark.parametrize("partial", [False, True])
def test_discard_drops_the_batches_ahead_and_the_next_one_samples_the_new_weights(partial):
    """A rollback: the batches generated ahead (and the one in flight) were sampled by the policy that
    collapsed. After discard and a sync, the next batch starts at the new version, staleness 0."""
    engine, counter = FakeEngine(), iter(range(1000))
    producer = RolloutProducer(engine, lambda: next(counter), engine.generate, max_staleness=2, partial=partial)
    first = producer.next()  # prompt 0; prompts 1 and 2 are queued behind it
    assert (first.prompts, len(producer.pending)) == (0, 2)
    assert producer.discard() == 2 and not producer.pending
    producer.sync_weights(None, 7)  # the restored weights
    after = producer.next()
    assert (after.prompts, after.staleness) == (3, 0)  # 1 and 2 are spent, never handed out
    assert [e for e in engine.log if e[0] == "generate" and e[1] == 3] == [("generate", 3, 7, 7)]
    producer.close()


def test_discard_drops_an_engine_error_of_a_dropped_batch():
    engine, counter = FakeEngine(fail_at=1), iter(range(1000))
    producer = RolloutProducer(engine, lambda: next(counter), engine.generate, max_staleness=1)
    producer.next()  # prompt 0; prompt 1 (fails) in flight
    assert producer.discard() == 1
    assert producer.next().prompts == 2
    producer.close()


def test_close_stops_a_batch_in_flight_at_its_next_engine_call():
    """A multi-turn batch generated ahead makes one engine call a turn. close() (the run ends, or a second
    signal stops it at once) waited for every remaining turn of a batch nobody would train on; now the
    call running finishes and the next one does not start. The turns started are counted."""
    engine = FakeEngine()
    in_turn, go_on, turns = threading.Event(), threading.Event(), []

    def eight_turns(prompt: int) -> Rollout:
        for turn in range(8):
            ro = producer.guarded.generate(prompt)
            turns.append(turn)
            if turn == 0:
                in_turn.set()
                assert go_on.wait(timeout=120), "the test never let the first turn end"
        return ro

    producer = RolloutProducer(engine, lambda: 0, eight_turns, max_staleness=1)
    producer._submit()
    assert in_turn.wait(timeout=120)
    closing = threading.Thread(target=producer.close)
    closing.start()
    while not producer.cancelled.is_set():  # close() has asked; the turn running now ends
        time.sleep(0.01)
    go_on.set()
    closing.join(timeout=120)
    assert not closing.is_alive() and turns == [0]  # the seven other turns never started
    assert isinstance(producer.pending[0].exception(), RolloutCancelled)
    assert producer.guarded.decodes_with_policy is False  # the rest is the engine's own
