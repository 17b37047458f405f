"""A round's whole wall-time bound: the waits on devices plus the server's own work around them.

The train and evaluation waits are sized by what the devices need (:meth:`Coordinator.bounds`:
deadline, learned round-trip overhead, grace). Around them the server pushes the model to every
sampled device, pulls their replies, checks, defends and aggregates, pushes the model again for
evaluation and scores: tens of megabytes per device, which on a busy host takes tens of seconds
that no device bound sees. Design notes:

* **Fixed when the train messages are out.** What came before (opening the round, waiting for a
  first-time device's query, the push) is measured; what comes after is promised: the train bound,
  the evaluation bound, and an allowance for the server's work after the train wait.
* **The allowance is learned** from the rounds this server ran (their largest recent cost, decaying,
  as a device's overhead is learned), times a margin; before the first round it is taken as twice the
  train push, since the aggregate and the evaluation push move the same bytes.
* **The evaluation wait gives way.** If the server's work overran its allowance, the evaluation
  wait shrinks by as much, so the round still ends within its bound; training is never cut short.
"""

from __future__ import annotations

from dataclasses import dataclass

SERVER_MARGIN = 1.5  # the allowance for the server's own work: this times what it cost lately ...
SERVER_SLACK_S = 2.0  # ... plus this (a quiet round's work can be close to nothing, and the next one not)
COST_DECAY = 0.8  # a learned cost follows a slower round at once and a faster one by this factor a round


class Lap:
    """The parts of a round the server times (metrics.jsonl's ``server_s``), each key spelled here once: the
    round loop writes them, the bound's learned server work reads them."""

    OPEN = "open_s"  # opening the round, the membership queries and the plan
    PUSH_TRAIN = "push_train_s"
    WAIT_TRAIN = "wait_train_s"
    AGGREGATE = "aggregate_s"  # checks, defense, average, and the queries to who connected meanwhile
    PUSH_EVAL = "push_eval_s"
    WAIT_EVAL = "wait_eval_s"
    CLOSE_EVAL = "close_eval_s"
    SERVER_EVAL = "server_eval_s"  # evaluation.server_test: the server scores the global model itself


WAIT_LAPS = (Lap.WAIT_TRAIN, Lap.WAIT_EVAL)  # timings spent waiting on devices; the rest is the server's own work
BEFORE_TRAIN_WAIT = (Lap.OPEN, Lap.PUSH_TRAIN)
AFTER_TRAIN_WAIT = (Lap.AGGREGATE, Lap.PUSH_EVAL)


@dataclass(frozen=True)
class ServerWork:
    """The server's own seconds in one round, around the waits on devices."""

    after_train_s: float  # from the end of the train wait to the start of the evaluation wait
    close_s: float  # from the end of the evaluation wait to the round's record


def learned(previous: float | None, sample: float) -> float:
    """A cost after one more round: a slower round at once, a faster one slowly."""
    return sample if previous is None else max(sample, COST_DECAY * previous)


def expected_work(previous: ServerWork | None, push_s: float) -> ServerWork:
    """What the server's work after the train wait will cost: as learned, else from the train push."""
    return previous or ServerWork(after_train_s=2.0 * push_s, close_s=0.5 * push_s)


def allowance(work: ServerWork) -> float:
    return SERVER_MARGIN * (work.after_train_s + work.close_s) + SERVER_SLACK_S


def round_bound(spent_s: float, train_bound_s: float, eval_bound_s: float | None, work: ServerWork) -> float:
    """The round's whole bound in wall seconds: ``spent_s`` so far, the train wait, the evaluation wait
    (None: the round does not evaluate) and the server's allowance."""
    return spent_s + train_bound_s + (eval_bound_s or 0.0) + allowance(work)


def evaluation_wait(eval_bound_s: float, left_s: float, work: ServerWork) -> float:
    """How long the evaluation may wait when ``left_s`` of the round's bound is left: its own bound, or
    less when the server's work has eaten into the round (the close still needs its share)."""
    close = SERVER_MARGIN * work.close_s + SERVER_SLACK_S / 2
    return max(0.0, min(eval_bound_s, left_s - close))


def learn_work(previous: ServerWork | None, sample: ServerWork) -> ServerWork:
    if previous is None:
        return sample
    return ServerWork(learned(previous.after_train_s, sample.after_train_s), learned(previous.close_s, sample.close_s))


def work_of(timings: dict[str, float], wall_s: float) -> ServerWork:
    """The server's own seconds of a round from its laps: after the train wait up to the evaluation
    wait, and whatever came after that."""
    after = sum(timings.get(k, 0.0) for k in AFTER_TRAIN_WAIT)
    before = sum(timings.get(k, 0.0) for k in (*BEFORE_TRAIN_WAIT, *WAIT_LAPS))
    return ServerWork(after_train_s=after, close_s=max(0.0, wall_s - before - after))
