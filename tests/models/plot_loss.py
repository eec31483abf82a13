#!/usr/bin/env python3
"""Draws the demo model's training loss curve (training_log.json) as a dependency-free SVG."""
import json
import sys

log = json.load(open(sys.argv[1]))
out = sys.argv[2]
pts = [(c["tokens"] / 1e6, c["loss"]) for c in log["curve"]]
W, H, M = 640, 360, 50
xmax = max(x for x, _ in pts)
ymin, ymax = min(y for _, y in pts), max(y for _, y in pts)
sx = lambda x: M + (W - 2 * M) * x / xmax
sy = lambda y: H - M - (H - 2 * M) * (y - ymin) / (ymax - ymin)
path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
ticks_y = [ymin + i * (ymax - ymin) / 5 for i in range(6)]
ticks_x = [i * xmax / 5 for i in range(6)]
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<polyline fill="none" stroke="#3366cc" stroke-width="1.2" points="{path}"/>',
       f'<line x1="{M}" y1="{H - M}" x2="{W - M}" y2="{H - M}" stroke="black"/>',
       f'<line x1="{M}" y1="{M}" x2="{M}" y2="{H - M}" stroke="black"/>']
for t in ticks_y:
    svg.append(f'<text x="{M - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:.2f}</text>')
for t in ticks_x:
    svg.append(f'<text x="{sx(t):.1f}" y="{H - M + 16}" text-anchor="middle">{t:.1f}</text>')
svg.append(f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">training tokens (millions)</text>')
svg.append(f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">training loss (nats/token)</text>')
svg.append(f'<text x="{W / 2}" y="24" text-anchor="middle">shimmer demo model: held-out perplexity {log["held_out_perplexity_bf16"]:.1f} (bf16)</text>')
svg.append("</svg>")
open(out, "w").write("\n".join(svg) + "\n")
print(f"wrote {out}")
