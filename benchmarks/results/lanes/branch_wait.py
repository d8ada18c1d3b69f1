"""Does a stream wait (cuStreamWaitValue32) in one branch of a CUDA graph hold up the other branch?"""

import time
from functools import partial

import torch

from tandem.engine.handoff import HostFlags, Launcher

dev = torch.device("cuda")
x = torch.zeros(1, device=dev)


def body_wait(flags):
    flags.wait_done(0)
    x.add_(1)


def body_signal(flags):
    torch.cuda._sleep(1000)
    flags.signal_ready(0)


def host(fa, fb, label):
    t0 = time.perf_counter()
    seen = False
    while time.perf_counter() - t0 < 2.0:
        if fb.ready(0):
            seen = True
            break
    took = time.perf_counter() - t0
    fa.set_done(0)
    fb.set_done(0)
    torch.cuda.synchronize()
    print(f"{label}: other branch signalled while one waits: {seen} ({took * 1e3:.2f} ms)", flush=True)


for order in ("wait-first", "signal-first"):
    fa, fb = HostFlags(1, dev), HostFlags(1, dev)
    torch.cuda.synchronize()
    base, sa, sb = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(base):
        g.capture_begin()
        pairs = [(sa, partial(body_wait, fa)), (sb, partial(body_signal, fb))]
        if order == "signal-first":
            pairs.reverse()
        for s, fn in pairs:
            s.wait_stream(base)
            with torch.cuda.stream(s):
                fn()
            base.wait_stream(s)
        g.capture_end()
    torch.cuda.synchronize()
    fa.reset()
    fb.reset()
    launcher = Launcher()
    launcher.start(g.replay)
    host(fa, fb, f"joint graph, {order}")
    launcher.join()
    launcher.close()

# separate graphs on separate streams
fa, fb = HostFlags(1, dev), HostFlags(1, dev)
graphs = []
for fn in (lambda: body_wait(fa), lambda: body_signal(fb)):
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin()
        fn()
        g.capture_end()
    graphs.append(g)
torch.cuda.synchronize()
fa.reset()
fb.reset()
sa, sb = torch.cuda.Stream(), torch.cuda.Stream()


def launch():
    with torch.cuda.stream(sa):
        graphs[0].replay()
    with torch.cuda.stream(sb):
        graphs[1].replay()


launcher = Launcher()
launcher.start(launch)
host(fa, fb, "separate graphs, two streams")
launcher.join()
launcher.close()
