"""A TCP proxy that delays every byte by D ms in each direction: network latency on loopback.

`tc qdisc ... netem` is what one would use, but this machine's kernel has no netem qdisc, so the RPC
benchmark (scripts/bench_rpc.py) puts this between the client and each worker instead. Bytes keep their
order and are not rate-limited; each chunk read is written D ms after it arrived. On SIGTERM or Ctrl-C it
prints, as one JSON line, the bytes it carried each way per route: what a real network would have to carry.

    python -m speculant.bench.netdelay --delay-ms 5 LISTEN_PORT:HOST:PORT [LISTEN_PORT:HOST:PORT ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, moved: dict,
                key: str) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(1 << 20):
            moved[key] += len(data)
            queue.put_nowait((loop.time() + delay, data))
    except (ConnectionError, OSError):
        pass
    queue.put_nowait((0.0, None))
    try:
        await sender
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other direction may still carry data
    except (ConnectionError, OSError):
        pass


async def _serve(listen_port: int, host: str, port: int, delay: float, moved: dict) -> asyncio.AbstractServer:
    async def handle(c_reader, c_writer):
        try:
            u_reader, u_writer = await asyncio.open_connection(host, port)
        except OSError:
            c_writer.close()
            return
        await asyncio.gather(_pump(c_reader, u_writer, delay, moved, "to_upstream"),
                             _pump(u_reader, c_writer, delay, moved, "from_upstream"))
        c_writer.close()
        u_writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", listen_port)


async def _main(routes: list[tuple[int, str, int]], delay: float) -> None:
    moved = {f"{lp}:{h}:{p}": {"to_upstream": 0, "from_upstream": 0} for lp, h, p in routes}
    servers = [await _serve(lp, h, p, delay, moved[f"{lp}:{h}:{p}"]) for lp, h, p in routes]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for s in servers:
        s.close()
    print(json.dumps(moved), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculant.bench.netdelay", description=__doc__.splitlines()[0])
    p.add_argument("--delay-ms", type=float, required=True, help="added one-way delay in milliseconds")
    p.add_argument("routes", nargs="+", metavar="LISTEN_PORT:HOST:PORT")
    args = p.parse_args(argv)
    routes = []
    for r in args.routes:
        lp, host, port = r.split(":")
        routes.append((int(lp), host, int(port)))
    try:
        asyncio.run(_main(routes, args.delay_ms / 1000))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
