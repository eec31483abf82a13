"""What the hostile-input scripts share: `shimmer run` on the demo model on a free port, and its
memory as /proc says it."""
import re
import subprocess
import sys
import threading


def start(binary: str, *args: str) -> tuple[subprocess.Popen, str]:
    """`shimmer run --port 0 --no-usage ARGS`, once it serves; its stderr is drained after."""
    proc = subprocess.Popen([binary, "run", "--port", "0", "--no-usage", *args], stderr=subprocess.PIPE, text=True)
    url = None
    while url is None:
        line = proc.stderr.readline()
        if not line:
            sys.exit("shimmer run did not start")
        m = re.search(r"on (http://[0-9.]+:[0-9]+)", line)
        url = m.group(1) if m else None
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, url


def memory_mb(proc: subprocess.Popen) -> tuple[float, float]:
    """The process's resident memory now and at its peak (VmRSS, VmHWM), in MB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{proc.pid}/status").read().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
