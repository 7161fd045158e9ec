"""What the measurement scripts share: a qlserve binary started on the default
model (port 0, 2 threads), raw HTTP/1.1 requests to it (from a chosen loopback
address, with a Host the server's Host rule accepts), its RSS and its event
loop's longest turn (CPU seconds, from /metrics)."""
import os, re, socket, subprocess, tempfile, time

MODEL = os.path.expanduser("~/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf")
HOST = b"Host: localhost\r\n"


class Served:
    def __init__(self, binary, extra=()):
        self.log = open(os.path.join(tempfile.gettempdir(), "qlserve-measure-%d.log" % os.getpid()), "w")
        self.proc = subprocess.Popen([binary, "serve", "--model", MODEL, "--port", "0", "--threads", "2",
                                      *extra], stdout=self.log, stderr=subprocess.STDOUT)
        self.port = None
        for _ in range(600):
            m = re.search(r"listening on http://127.0.0.1:(\d+)", open(self.log.name).read())
            if m:
                self.port = int(m.group(1))
                break
            time.sleep(0.1)
        while True:  # the model loads behind /health's 503
            try:
                if self.get("/health").startswith(b"HTTP/1.1 200"):
                    break
            except OSError:
                pass
            time.sleep(0.2)

    def connect(self, src="127.0.0.1", timeout=600):
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout, source_address=(src, 0))

    def request(self, raw, src="127.0.0.1", timeout=600):
        """raw sent, the whole answer read (to the server's close)."""
        s = self.connect(src, timeout)
        s.sendall(raw)
        data = b""
        while True:
            try:
                b = s.recv(1 << 20)
            except ConnectionResetError:
                break
            if not b:
                break
            data += b
        s.close()
        return data

    def get(self, path, src="127.0.0.1"):
        return self.request(b"GET %s HTTP/1.1\r\n%sConnection: close\r\n\r\n" % (path.encode(), HOST), src)

    def rss_mib(self):
        for line in open("/proc/%d/status" % self.proc.pid):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024

    def turn_max(self):
        m = re.search(rb"\nqlserve_event_loop_turn_cpu_seconds_max ([0-9.e+-]+)", self.get("/metrics"))
        return float(m.group(1))

    def stop(self):
        self.proc.terminate()
        self.proc.wait()
