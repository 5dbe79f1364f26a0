"""Which box `flash wait` and `flash serve`'s start check blame when several are down (issue 35:
a lost rank takes the head down a moment later, and the head is listed first)."""

from __future__ import annotations

from types import SimpleNamespace

from flash_cli import deploy
from flash_cli.engine import State


def box(i: int, role: str) -> deploy.Box:
    return deploy.Box(i, f"box{i}", f"ssh://box{i}", None, SimpleNamespace(labels={"org.flash.role": role}))


def test_the_box_that_ended_first_is_named_not_the_first_listed():
    head, w1, w2 = box(0, "head"), box(1, "worker"), box(2, "worker")
    states = [(head, State("exited", 1, finished_at="2026-12-04T21:33:59.912345678Z")),
              (w1, State("running")),
              (w2, State("exited", 137, finished_at="2026-12-04T21:33:59.101010101Z"))]
    b, st, also = deploy.first_down(states)
    assert b is w2 and st.exit_code == 137 and also == [head]


def test_a_box_without_an_end_time_sorts_after_those_with_one():
    head, w1 = box(0, "head"), box(1, "worker")
    states = [(head, State("dead", None, finished_at="0001-01-01T00:00:00Z")),
              (w1, State("exited", 1, finished_at="2026-12-04T21:00:00Z"))]
    assert deploy.first_down(states)[0] is w1


def test_up_boxes_are_none_and_serve_counts_restarting_as_down():
    head, w1 = box(0, "head"), box(1, "worker")
    assert deploy.first_down([(head, State("running")), (w1, State("restarting"))]) is None
    b, _, also = deploy.first_down([(head, State("running")), (w1, State("restarting"))], up=("created", "running"))
    assert b is w1 and also == []


def test_the_message_names_the_cause_and_the_others(monkeypatch, capsys):
    head, w2 = box(0, "head"), box(2, "worker")
    monkeypatch.setattr(deploy.engine, "tail", lambda c, n: ["boom"])
    w2.container.name = "flash-x-node2"
    err = deploy.died(w2, State("exited", 137, oom_killed=True), also=[head])
    assert "node 2 (worker) on box2" in str(err) and "OOM-killed" in str(err)
    assert "after it: node 0 (head) on box0 went down too" in str(err)
    assert "boom" in capsys.readouterr().err


def test_end_times_compare_as_times_not_as_docker_wrote_them():
    """Docker trims trailing zeros from FinishedAt (RFC 3339 nano): as text, '…:59.5Z' sorts before
    '…:59Z' and '…:59.912Z' before '…:59.91Z'; as times the earlier end is the cause."""
    head, w1 = box(0, "head"), box(1, "worker")
    for earlier, later in [("2026-12-04T21:33:59Z", "2026-12-04T21:33:59.5Z"),
                           ("2026-12-04T21:33:59.91Z", "2026-12-04T21:33:59.912Z"),
                           ("2026-12-04T22:33:59+01:00", "2026-12-04T21:34:00Z")]:
        for first, second in [(head, w1), (w1, head)]:
            states = [(first, State("exited", 1, finished_at=later)), (second, State("exited", 1, finished_at=earlier))]
            assert deploy.first_down(sorted(states, key=lambda x: x[0].node))[0] is second, (earlier, later)


def test_docker_timestamps_parse():
    from flash_cli.engine import epoch

    assert epoch("2026-12-04T21:33:59.5Z") - epoch("2026-12-04T21:33:59Z") == 0.5
    assert epoch("2026-12-04T21:33:59.001Z") > epoch("2026-12-04T21:33:59Z")  # (float64 holds ~0.2 µs here)
    assert epoch("0001-01-01T00:00:00Z") is None and epoch("") is None and epoch("yesterday") is None


class Timeline:
    """Engines whose states change at given times on a fake clock (sleep advances it)."""

    def __init__(self, events: dict[str, list[tuple[float, State]]]):
        self.t, self.events = 0.0, events

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s

    def read(self, b: deploy.Box) -> State:
        return [st for at, st in self.events[b.node] if at <= self.t][-1]


def test_a_worker_whose_engine_reports_its_exit_late_is_still_named():
    """The CI flake of 2d797f6: the killed worker's engine still said running when the head's said
    exited; one read named the head. Settling names the worker, which ended first."""
    head, w1, w2 = box(0, "head"), box(1, "worker"), box(2, "worker")
    tl = Timeline({"0": [(0, State("exited", 1, finished_at="2026-12-05T16:52:25.40Z"))],
                   "1": [(0, State("running"))],
                   "2": [(0, State("running")), (0.6, State("exited", 137, finished_at="2026-12-05T16:52:25.10Z"))]})
    b, st, also = deploy.settled_down([head, w1, w2], read=tl.read, clock=tl.clock, sleep=tl.sleep)
    assert b is w2 and st.exit_code == 137 and also == [head]
    assert 2.6 <= tl.t <= 3.0  # waited for the change, then quiet_s (2 s) more, not the whole limit


def test_settling_is_bounded_and_free_when_every_box_is_up():
    head, w1 = box(0, "head"), box(1, "worker")
    up = Timeline({"0": [(0, State("running"))], "1": [(0, State("running"))]})
    assert deploy.settled_down([head, w1], read=up.read, clock=up.clock, sleep=up.sleep) is None and up.t == 0
    # a box that flaps forever: the answer still comes by limit_s
    flap = Timeline({"0": [(0, State("exited", 1, finished_at="2026-12-05T16:00:00Z"))],
                     "1": [(i * 0.25, State("exited" if i % 2 else "running", 1, finished_at="2026-12-05T16:00:01Z"))
                           for i in range(200)]})
    b, _, _ = deploy.settled_down([head, w1], read=flap.read, clock=flap.clock, sleep=flap.sleep)
    assert b is head and 8.0 <= flap.t <= 8.25


def test_a_killed_rank_is_the_cause_before_a_head_stamped_a_moment_earlier():
    """The tp4ep engine test's failure: the killed rank's engine stamped its exit after the head's,
    which exited (code 1) because of it. Within CLOSE_S a box killed by a signal or the OOM killer
    is the cause; farther apart, the earlier end still wins, whatever the exit codes."""
    head, w1, w2, w3 = box(0, "head"), box(1, "worker"), box(2, "worker"), box(3, "worker")
    states = [(head, State("exited", 1, finished_at="2026-12-06T15:07:30.100Z")),
              (w1, State("exited", 1, finished_at="2026-12-06T15:07:30.900Z")),
              (w2, State("exited", 137, finished_at="2026-12-06T15:07:30.104Z")),
              (w3, State("exited", 1, finished_at="2026-12-06T15:07:30.950Z"))]
    b, st, also = deploy.first_down(states)
    assert b is w2 and also == [head, w1, w3]
    oom = [(head, State("exited", 1, finished_at="2026-12-06T15:07:30.100Z")),
           (w1, State("exited", 1, oom_killed=True, finished_at="2026-12-06T15:07:30.300Z"))]
    assert deploy.first_down(oom)[0] is w1
    late = 30.1 + deploy.CLOSE_S + 0.01  # past the window: the stamps are trusted
    apart = [(head, State("exited", 1, finished_at="2026-12-06T15:07:30.100Z")),
             (w2, State("exited", 137, finished_at=f"2026-12-06T15:07:{late:06.3f}Z"))]
    assert deploy.first_down(apart)[0] is head
    both = [(head, State("exited", 137, finished_at="2026-12-06T15:07:30.200Z")),
            (w2, State("exited", 139, finished_at="2026-12-06T15:07:30.100Z"))]
    assert deploy.first_down(both)[0] is w2  # both killed: the earlier stamp
    never = [(head, State("dead", 137, finished_at="0001-01-01T00:00:00Z")),
             (w2, State("exited", 1, finished_at="2026-12-06T15:07:30.100Z"))]
    assert deploy.first_down(never)[0] is w2  # a box with no end time is not "close" to one with
