#!/usr/bin/env python3
"""A slow, lossy link for one host of scripts/hosts.sh, in user space, for kernels without
netem (tc's sch_netem).

  scripts/slowlink.py --host I --delay-ms 50 --loss 0.01

replaces host I's veth with two TAP devices, one on the bridge (hxh-I-h) and one in the
host's namespace (hxh-I-n, same address), and forwards Ethernet frames between them: a frame
toward the host waits --delay-ms (as netem on the bridge's end of the link would delay it),
and a frame either way is dropped with probability --loss. It prints "ready"
once the link is up, runs until SIGTERM/SIGINT, then puts the veth back (hosts.sh relink I).
Frames keep their order; the forwarder is one Python process (plus one in the namespace), fine
for tests, not for bandwidth.
"""

import argparse
import collections
import fcntl
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTS = os.path.join(HERE, "hosts.sh")
TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000
FRAME = 65536
READY = b"slowlink ready"


def open_tap(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def ip(*args):
    subprocess.run(["ip", *args], check=True)


def end_main(fd, tap):
    """In the host's namespace: frames between its TAP and the forwarder, unchanged."""
    sock = socket.socket(fileno=fd)
    t = open_tap(tap)
    sock.send(READY)  # the link has carrier now: ranks started after this see it
    sock.setblocking(False)
    while True:
        r, _, _ = select.select([t, sock], [], [])
        if t in r:
            try:
                sock.send(os.read(t, FRAME))
            except (BlockingIOError, OSError):
                pass
        if sock in r:
            data = sock.recv(FRAME)
            if not data:
                return 0
            try:
                os.write(t, data)
            except OSError:
                pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, default=50.0)
    ap.add_argument("--loss", type=float, default=0.01, help="probability a frame is dropped")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--end", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tap", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.end is not None:
        return end_main(args.end, args.tap)

    i = args.host
    ns, outer, inner = f"hxh-{i}", f"hxh-{i}-h", f"hxh-{i}-n"
    address = subprocess.run([HOSTS, "addr", str(i)], capture_output=True, text=True,
                             check=True).stdout.strip()
    ip("link", "del", outer)  # the veth pair: both ends go
    ip("tuntap", "add", "dev", outer, "mode", "tap")
    ip("link", "set", outer, "master", "hxh-br", "up")
    ip("tuntap", "add", "dev", inner, "mode", "tap")
    ip("link", "set", inner, "netns", ns)
    ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
    ip("-n", ns, "link", "set", inner, "up")
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, __file__, "--host",
                              str(i), "--end", str(there.fileno()), "--tap", inner],
                             pass_fds=[there.fileno()])
    there.close()
    here.settimeout(10)
    if here.recv(FRAME) != READY:  # ranks enumerate interfaces once: wait for carrier
        raise SystemExit(f"slowlink: the end in {ns} did not open {inner}")
    tap = open_tap(outer)
    subprocess.run([HOSTS, "forget"], check=False)  # host I has a new MAC address
    here.setblocking(False)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    rng = random.Random(args.seed)
    delay = args.delay_ms / 1e3
    # Per direction, (release time, frame) in arrival order: toward the host (into the
    # socket) frames wait `delay`, from it they go at once.
    queues = {here: collections.deque(), tap: collections.deque()}
    wait = {here: delay, tap: 0.0}
    dropped = forwarded = 0
    print("ready", flush=True)
    try:
        while not stop:
            heads = [q[0][0] for q in queues.values() if q]
            timeout = max(0.0, min(heads) - time.monotonic()) if heads else 0.2
            try:
                r, _, _ = select.select([tap, here], [], [], timeout)
            except InterruptedError:
                continue
            now = time.monotonic()
            for src, dst in ((tap, here), (here, tap)):
                if src not in r:
                    continue
                try:
                    data = os.read(tap, FRAME) if src is tap else here.recv(FRAME)
                except (BlockingIOError, OSError):
                    continue
                if rng.random() < args.loss:
                    dropped += 1
                    continue
                queues[dst].append((now + wait[dst], data))
            for dst, q in queues.items():
                while q and q[0][0] <= time.monotonic():
                    _, data = q.popleft()
                    try:
                        if dst is tap:
                            os.write(tap, data)
                        else:
                            here.send(data)
                        forwarded += 1
                    except (BlockingIOError, OSError):
                        dropped += 1
    finally:
        child.terminate()
        child.wait()
        os.close(tap)
        subprocess.run([HOSTS, "relink", str(i)], check=False)
        print(f"forwarded {forwarded} frames, dropped {dropped}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
