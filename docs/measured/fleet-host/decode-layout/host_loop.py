"""One bench-host setting's host work, run many times in one process: bench-host's engine over
its InstantRunner (the in-process store; torch on one thread; the heap frozen as a server's),
one ``generate_many`` of N sessions x 64 tokens warmed up once, then run REPS times. Prints the
host microseconds a session-step, wall then the thread's CPU (the runner's answers left out),
and on a second line the timed runs' session-steps and a digest of the last run's outputs
(what ``../instructions/instructions_per_step.py`` reads when it runs this under callgrind).

    python host_loop.py DRAFTER N REPS     # e.g. mag 64 30
"""

import hashlib
import sys
import time

from edgespec.config import SamplingParams
from edgespec.engine.generation import Request
from edgespec.runner.process_heap import freeze_startup_heap
from edgespec.runner.threads import set_threads
from edgespec_cli.bench.host_cost import _engine, _prompts


def main() -> None:
    set_threads(1)
    drafter, n, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    engine, runner, close = _engine("local", drafter, n, 0.9)
    freeze_startup_heap()
    prompts = _prompts(n, runner)
    state = engine.drafter.snapshot() if engine.drafter else None
    session_steps = [0]
    step = engine.step

    def counting_step():
        session_steps[0] += len(engine.active)
        return step()

    engine.step = counting_step

    def run() -> list[list[int]]:
        results = engine.generate_many([Request(list(p), 64, SamplingParams()) for p in prompts])
        if state is not None:  # each run drafts from the table as it was before the warm-up
            engine.drafter.restore(state)
        return [r.token_ids for r in results]

    run()
    session_steps[0] = 0
    runner.runner_s = runner.runner_cpu_s = 0.0
    t0, c0 = time.perf_counter(), time.thread_time()
    outputs: list[list[int]] = []
    for _ in range(reps):
        outputs = run()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    print(f"{1e6 * (wall - runner.runner_s) / session_steps[0]:.2f} "
          f"{1e6 * (cpu - runner.runner_cpu_s) / session_steps[0]:.2f} us/session-step wall, cpu")
    print(f"session_steps {session_steps[0]} digest "
          f"{hashlib.sha1(repr(outputs).encode()).hexdigest()[:16]}")
    engine.close()
    close()


if __name__ == "__main__":
    main()
