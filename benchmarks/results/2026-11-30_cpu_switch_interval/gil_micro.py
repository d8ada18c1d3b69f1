"""What a thread that gives up the GIL pays to win it back beside a thread spinning in Python: the mean time of a
small torch op and of a ctypes call, alone and beside the spinner, at the switch interval given (seconds)."""
import ctypes
import sys
import threading
import time

import torch

sys.setswitchinterval(float(sys.argv[1]) if len(sys.argv) > 1 else 0.0002)
x = torch.zeros(16)
buf = ctypes.create_string_buffer(16)


def per_call(fn, n):
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def measure(n):
    return f"torch op {per_call(x.zero_, n):.2f} us, ctypes call {per_call(lambda: ctypes.memset(buf, 0, 16), n):.2f} us"


print(f"interval {sys.getswitchinterval() * 1e3:g} ms, alone: {measure(2000)}")
stop = threading.Event()


def spin():
    i = 0
    while not stop.is_set():
        i += 1


thread = threading.Thread(target=spin)
thread.start()
time.sleep(0.05)
print(f"interval {sys.getswitchinterval() * 1e3:g} ms, beside a spinning thread: {measure(500)}")
stop.set()
thread.join()
