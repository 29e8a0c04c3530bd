"""Test hosts made of network namespaces (deploy/netns_hosts.sh), for running a
cluster across "machines" on one machine: each host has its own address on a
private bridge and its own hostname, mpirun reaches it through an rsh agent, and
MPI moves data between hosts over TCP only. Standard library only; needs root.

    hosts = NetHosts(n=3)          # pdh1..pdh3 + the client namespace pdhc
    reason = hosts.probe()         # None, or why this machine cannot make them
    hosts.up()                     # cleans up a crashed run's leftovers first
    try: ... finally: hosts.down()"""
import atexit
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "deploy", "netns_hosts.sh")
LOCK = "/run/lock/pdcluster-netns.lock"


class NetHosts:
    def __init__(self, n=3, prefix=None, subnet=None):
        self.n = n
        self.prefix = prefix or os.environ.get("PDH_PREFIX", "pdh")
        self.subnet = subnet or os.environ.get("PDH_SUBNET", "10.213.77")
        self.env = dict(os.environ, PDH_PREFIX=self.prefix, PDH_SUBNET=self.subnet)
        self._lock = None
        self._is_up = False

    # ---- names and addresses
    def host(self, i):
        return "%s%d" % (self.prefix, i)

    @property
    def client(self):
        return self.prefix + "c"

    @property
    def cidr(self):
        return self.subnet + ".0/24"

    def addr(self, host):
        return self.subnet + (".100" if host == self.client else "." + host[len(self.prefix):])

    @property
    def rsh_agent(self):
        """The value of OpenMPI's plm_rsh_agent: the script in its ssh-like mode."""
        return SCRIPT + " rsh"

    def mca_args(self, btl="tcp,self,vader", verbose=False):
        """launch.sh flags for a job over these hosts: mpirun reaches them through the
        rsh agent; its daemons (oob) and the ranks (btl tcp) use only the bridge's
        subnet; ob1 with the TCP BTL between hosts (vader only within one)."""
        args = ["--mca", "plm_rsh_agent", self.rsh_agent, "--mca", "oob_tcp_if_include", self.cidr,
                "--mca", "btl_tcp_if_include", self.cidr, "--mca", "pml", "ob1", "--mca", "btl", btl]
        if verbose:
            args += ["--mca", "btl_base_verbose", "100"]
        return args

    def write_hostfile(self, path, slots):
        """slots: [(host, n)] -> an OpenMPI hostfile, in that order."""
        with open(path, "w") as f:
            for host, n in slots:
                f.write("%s slots=%d\n" % (host, n))
        return path

    def exec_argv(self, host, argv):
        """argv run on host: in its network namespace, under its hostname."""
        return [SCRIPT, "exec", host] + list(argv)

    # ---- lifecycle
    def sh(self, *args, check=True):
        r = subprocess.run([SCRIPT] + list(args), env=self.env, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError("netns_hosts.sh %s failed (%d): %s" % (" ".join(args), r.returncode,
                                                                     (r.stderr or r.stdout).strip()))
        return r.stdout.strip()

    def probe(self, need_tc=False):
        """None if this machine can make the hosts, else the reason it cannot."""
        if os.geteuid() != 0:
            return "not root (network namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN)"
        for tool, pkg in (("ip", "iproute2"), ("unshare", "util-linux")) + ((("tc", "iproute2"),) if need_tc else ()):
            if not shutil.which(tool):
                return "'%s' not found (apt-get install %s)" % (tool, pkg)
        ns, br = self.prefix + "-probe", self.prefix + "-pbr"
        steps = [["ip", "netns", "add", ns],
                 ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "hostname", "probe"],
                 ["ip", "link", "add", br, "type", "bridge"],
                 ["ip", "link", "add", self.prefix + "-pv", "type", "veth", "peer", "name", "eth0", "netns", ns]]
        if need_tc:
            steps.append(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                          "1gbit", "burst", "256kb", "latency", "50ms"])
        def clean():
            subprocess.run(["ip", "link", "del", self.prefix + "-pv"], capture_output=True)
            subprocess.run(["ip", "link", "del", br], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        clean()  # a crashed probe's leftovers
        try:
            for cmd in steps:
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    return "'%s' failed: %s" % (" ".join(cmd), (r.stderr or r.stdout).strip())
            return None
        finally:
            clean()

    def up(self, lock_wait_s=120):
        """Takes the hosts' lock (one run at a time on this machine), removes what a
        crashed run left, makes the hosts. Teardown is registered with atexit, and
        SIGTERM/SIGHUP become SystemExit so that try/finally blocks run too."""
        self._take_lock(lock_wait_s)
        atexit.register(self.down)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _exit_on_signal)
        self._is_up = True
        return self.sh("up", str(self.n))

    def down(self):
        if self._is_up:
            self._is_up = False
            r = subprocess.run([SCRIPT, "down"], env=self.env, capture_output=True, text=True)
            if r.returncode != 0:
                print("netns: teardown failed: %s" % (r.stderr or r.stdout).strip(), file=sys.stderr)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def leftovers(self):
        """Namespaces and links of this prefix that exist now (for the teardown check)."""
        ns = [l.split()[0] for l in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                   text=True).stdout.splitlines() if l.strip()]
        links = [l.split(": ")[1].split("@")[0] for l in subprocess.run(["ip", "-o", "link", "show"],
                                                                         capture_output=True, text=True).stdout.splitlines()]
        pre = self.prefix
        return ([n for n in ns if n.startswith(pre) and (n[len(pre):].isdigit() or n[len(pre):] == "c")] +
                [l for l in links if l.startswith(pre + "-")])

    def _take_lock(self, wait_s):
        os.makedirs(os.path.dirname(LOCK), exist_ok=True)
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.time() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES) or time.time() > deadline:
                    os.close(fd)
                    raise RuntimeError("another run holds the test hosts (lock %s) for over %d s" % (LOCK, wait_s))
                time.sleep(0.5)
        self._lock = fd

    # ---- the link
    def throttle(self, host, rate, delay=None):
        """tc on both directions of host's link: netem (rate + delay) where the kernel
        has it, else tbf (rate only). Returns the line that says which."""
        return self.sh("throttle", host, rate, *([delay] if delay else []))

    def unthrottle(self, host):
        self.sh("unthrottle", host)

    def netns_of(self, pid):
        """The name of the namespace process pid runs in ('' for the root one)."""
        return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()

    def link_rate(self, src, dst, nbytes=64 << 20, port=5299):
        """One TCP stream src -> dst of nbytes; returns (bits/s, seconds) measured by the
        receiver from its first byte to the last."""
        server = subprocess.Popen(self.exec_argv(dst, [sys.executable, "-c", _SINK, self.addr(dst), str(port)]),
                                  env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = server.stdout.readline()
            if ready.strip() != "ready":
                raise RuntimeError("link probe: the receiver did not start: %s %s" % (ready, server.stderr.read()))
            subprocess.run(self.exec_argv(src, [sys.executable, "-c", _SOURCE, self.addr(dst), str(port), str(nbytes)]),
                           env=self.env, check=True, timeout=120)
            out, err = server.communicate(timeout=120)
            res = json.loads(out)
            if res["bytes"] != nbytes:
                raise RuntimeError("link probe: %d of %d bytes arrived" % (res["bytes"], nbytes))
            return res["bytes"] * 8 / res["seconds"], res["seconds"]
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


_SINK = r"""
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.monotonic()
    n += len(b)
print(json.dumps({"bytes": n, "seconds": time.monotonic() - t0}))
"""

_SOURCE = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
buf = b"x" * (1 << 20); left = int(sys.argv[3])
while left > 0:
    k = min(left, len(buf)); c.sendall(buf[:k]); left -= k
c.close()
"""

