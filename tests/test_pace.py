"""A shaped stream's clock (core/serve/pace.py, specx.live.stream_pace), learned from the decode
steps a core.cost.learned.LearnedCost sees: slots about a plain step apart that a plain decoding
stays ahead of, and drafts only where a request is ahead of its clock."""

from specx.core.cost.forward import ForwardCost
from specx.core.cost.learned import LearnedCost


def test_a_shaped_streams_slot_holds_a_plain_step_and_drafts_run_only_ahead_of_it():
    """specx.live.stream_pace: slots a plain step's mean time apart and a little more, spreading
    (an interval asked below that is raised with tenants);
    core.serve.pace.PacedCost: a shaped request drafts n nodes (at most SHAPED_DRAFT, whatever the
    guard would allow) only where a step of 1 + n tokens and a plain one after it end before the
    next slot, none before its first token."""
    from types import SimpleNamespace

    from specx.core.decode.request import Decoding
    from specx.core.serve.pace import Clock, PacedCost
    from specx.live import LEARNED_PASSES, PACE_MARGIN, PACE_SPREADS, SHAPED_DRAFT, stream_pace

    cost = LearnedCost(ForwardCost((1, 8, 16), (0.01, 0.02, 0.03)))
    for i in range(LEARNED_PASSES + 40):  # steps 1.1x their pass, one in ten 1.5x; drafts all accepted
        cost.observe_step(num_tokens=1 + i % 3, context=300, verify_seconds=0.01 * (1 + 0.2 * (i % 3)),
                          step_seconds=0.01 * (1 + 0.2 * (i % 3)) * (1.5 if i % 10 == 0 else 1.1), num_out=1 + i % 3)
    stack = SimpleNamespace(cost=cost)
    req = SimpleNamespace(prompt_ids=list(range(200)), settings=Decoding(max_new_tokens=50))
    pace = stream_pace(stack, None)(req)
    assert cost.max_draft() == SHAPED_DRAFT and len(pace.steps) == SHAPED_DRAFT + 1
    mean, spread = cost.plain_step(256)
    assert pace.interval == mean * (1 + PACE_MARGIN) > cost(1, 256) * 1.1 and pace.spread == PACE_SPREADS * spread > 0
    assert pace.steps[0] == cost.step_bound(1, 256) > pace.interval  # a plain step's bound: its high quantile
    assert list(pace.steps) == sorted(pace.steps) and pace.steps[-1] == cost.step_bound(1 + SHAPED_DRAFT, 256)
    assert stream_pace(stack, 0.001, at_least_plain=True)(req) == pace  # with tenants: never below a plain step
    assert stream_pace(stack, 1000.0, at_least_plain=True)(req).interval == 1.0  # above it: the interval asked

    now = [0.0]
    clock = Clock(pace.interval)
    paced = PacedCost(cost, pace, clock, now=lambda: now[0])
    assert paced.max_draft() == 0  # before the first token: its clock has not started
    clock.delay(0.0)  # the first token: the next slot is one interval away, less than a plain step twice
    assert paced.max_draft() == 0
    for _ in range(4):  # tokens ready early: the request is four slots ahead of its clock
        clock.delay(0.0)
    assert paced.max_draft() == SHAPED_DRAFT
    allowed = [n for n in range(SHAPED_DRAFT + 1) if pace.steps[n] + pace.steps[0] <= pace.interval * 5 - 0.001]
    now[0] = 0.001
    assert paced.max_draft() == allowed[-1]
    now[0] = pace.interval * 5 - (pace.steps[0] + pace.steps[1]) * 0.99  # room for a plain step twice, not a drafted one
    assert paced.max_draft() == 0
    assert paced.shape(4, 300) == cost.shape(4, 300) and paced(2, 300) == cost(2, 300)  # the rest is the cost's


def test_plain_decoding_stays_ahead_of_a_shaped_clock_at_any_length():
    """A shaped clock learned from plain steps that vary at random (core.cost.learned.plain_step,
    specx.live.stream_pace): fresh plain decodings drawn from the same steps are rarely behind it,
    at 24 tokens as at 256, for less time a token than slots a plain step's high quantile apart."""
    import random
    from types import SimpleNamespace

    from specx.core.decode.request import Decoding
    from specx.core.serve.pace import Clock
    from specx.live import stream_pace

    rng = random.Random(5)
    step = lambda: 0.004 * rng.lognormvariate(0, 0.25)  # noqa: E731 - a plain step's seconds, spread as a busy VM's
    cost = LearnedCost(ForwardCost((1, 8), (0.004, 0.008)))
    for _ in range(600):
        seconds = step()
        cost.observe_step(num_tokens=1, context=300, verify_seconds=seconds * 0.9, step_seconds=seconds, num_out=1)
    req = SimpleNamespace(prompt_ids=list(range(200)), settings=Decoding(max_new_tokens=56))
    pace = stream_pace(SimpleNamespace(cost=cost), None)(req)

    def run(clock_of, tokens: int, answers: int = 200) -> tuple[float, float]:
        """(share of tokens ready after their slot, seconds a token the clock took)"""
        late, seconds = 0, 0.0
        for _ in range(answers):
            clock, now = clock_of(), 0.0
            for _ in range(tokens):
                late += clock.next is not None and now > clock.next + 1e-12
                clock.delay(now)
                now += step()
            seconds += clock.next
        return late / (answers * tokens), seconds / (answers * tokens)
    for tokens in (24, 256):
        late, seconds = run(lambda: Clock(pace.interval, pace.spread), tokens)
        quantile_late, quantile_seconds = run(lambda: Clock(pace.steps[0]), tokens)  # slots a high quantile apart
        assert late < 0.005 and seconds < quantile_seconds * 0.9
