"""Vision figures (issue 34): image-encode time, projector memory, and time to first token for chats with one
image at 1 and 8 concurrent streams, for Pantheon and, on the same GGUF files, llama.cpp's server.

    # Pantheon's encoder in process: projector bytes on the die, encode time of one image (all its tiles)
    python tools/vision_bench.py encode --model TEXT.gguf --mmproj PROJ.gguf --image IMG.png

    # time to first token through any OpenAI-compatible server (Pantheon's, or llama-server --mmproj)
    python tools/vision_bench.py ttft --url http://127.0.0.1:PORT --model NAME --image IMG.png --streams 1,8

    # llama-server's own figures from its log (run it with --log-file or 2> LOG): encode ms, projector MiB
    python tools/vision_bench.py llama-log LOG

Every request of `ttft` carries an image of its own (the given one with one pixel changed per request), so
no server answers from an image or prefix it has seen: each first token waits for a full encode and
prefill. `max_tokens` is 1: the first token is the whole answer, so a server that streams it without
text (a special token of a random-weight model) is timed to the stream's end. A round sends `streams`
requests at once; the figure is the median over the rounds' requests (and the slowest request's median,
which is what the last of 8 waits).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path


def variant(path: Path, k: int) -> str:
    """The image as a PNG data URL with pixel (0, 0) set from k: same size (same tiles), other content."""
    from PIL import Image
    img = Image.open(path).convert("RGB")
    img.putpixel((0, 0), (k * 37 % 256, k * 91 % 256, k * 53 % 256))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def first_token_s(url: str, model: str, data_url: str, max_tokens: int) -> float:
    """Seconds from sending one streamed chat with the image to the first chunk with text, or to the end
    of the stream when no token has text (with max_tokens 1: the first token's time either way)."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": data_url}},
                           {"type": "text", "text": "What is in this image?"}]}]}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                dt = time.perf_counter() - t0
                resp.read()
                return dt
    # every token so far had no text (a random-weight model picks special tokens too): with max_tokens 1
    # the stream's end is the first token's time
    return time.perf_counter() - t0


def ttft(args: argparse.Namespace) -> dict:
    image = Path(args.image)
    k = 1000
    first_token_s(args.url, args.model, variant(image, 0), args.max_tokens)  # warm: programs, pools
    out = {}
    for n in (int(s) for s in args.streams.split(",")):
        each, slowest = [], []
        for _ in range(args.rounds):
            urls = [variant(image, k + i) for i in range(n)]
            k += n
            got: list[float] = [0.0] * n

            def run(i: int) -> None:
                got[i] = first_token_s(args.url, args.model, urls[i], args.max_tokens)

            threads = [threading.Thread(target=run, args=(i,), name=f"vision-bench-{i}") for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            each += got
            slowest.append(max(got))
        out[n] = {"median_ms": statistics.median(each) * 1000, "slowest_median_ms": statistics.median(slowest) * 1000,
                  "requests": len(each)}
        print(f"{n} stream(s): time to first token median {out[n]['median_ms']:8.1f} ms, "
              f"slowest of the round (median) {out[n]['slowest_median_ms']:8.1f} ms  ({len(each)} requests)")
    return out


def encode(args: argparse.Namespace) -> dict:
    from PIL import Image

    from pantheon.formats import images
    from pantheon.ops import weights
    from pantheon.runtime import engine
    m = engine.load(Path(args.model), engine.LoadOptions(mmproj=args.mmproj, n_slots=1, max_seq=args.max_seq))
    try:
        v = m.card.vision
        img = Image.open(args.image)
        t0 = time.perf_counter()
        if v.tiling:
            cut = images.tiles(img, v.image_size, v.tiling, v.mean, v.std)
            pics, grid = [t.pixels for t in cut.tiles], f"{cut.rows} x {cut.cols} tiles + the whole image"
        else:
            pics, grid = [images.preprocess(img, v.image_size, v.mean, v.std).pixels], "one image"
        prep = time.perf_counter() - t0
        m.encode_images(pics)  # warm (the one program is compiled at load; this also pages the weights in)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            m.encode_images(pics)
            times.append(time.perf_counter() - t0)
        res = {"projector_bytes": weights.tree_bytes(m.vision_params), "encoder_inputs": len(pics), "grid": grid,
               "tokens": len(pics) * v.n_tokens, "preprocess_ms": prep * 1000,
               "encode_ms": statistics.median(times) * 1000}
    finally:
        m.free()
    print(f"projector on the die: {res['projector_bytes'] / 2**20:.2f} MiB; image: {grid} = {len(pics)} encoder "
          f"inputs, {res['tokens']} tokens; preprocess {res['preprocess_ms']:.1f} ms; encode (median of "
          f"{args.repeat}) {res['encode_ms']:.1f} ms")
    return res


def llama_log(args: argparse.Namespace) -> dict:
    text = Path(args.log).read_text(errors="replace")
    slices = [int(x) for x in re.findall(r"slice encoded in (\d+) ms", text)]
    size = re.findall(r"model size:\s+([\d.]+) MiB", text)
    res = {"slices": len(slices), "slice_encode_ms_median": statistics.median(slices) if slices else None,
           "projector_mib": float(size[-1]) if size else None}
    print(json.dumps(res))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("encode")
    e.add_argument("--model", required=True)
    e.add_argument("--mmproj", required=True)
    e.add_argument("--image", required=True)
    e.add_argument("--repeat", type=int, default=5)
    e.add_argument("--max-seq", type=int, default=256)
    t = sub.add_parser("ttft")
    t.add_argument("--url", required=True)
    t.add_argument("--model", required=True)
    t.add_argument("--image", required=True)
    t.add_argument("--streams", default="1,8")
    t.add_argument("--rounds", type=int, default=3)
    t.add_argument("--max-tokens", type=int, default=1)
    g = sub.add_parser("llama-log")
    g.add_argument("log")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line at the end")
    args = ap.parse_args(argv)
    res = {"encode": encode, "ttft": ttft, "llama-log": llama_log}[args.cmd](args)
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
