//! A test cluster built by the tests themselves: network namespaces ("hosts"), each with
//! its own OpenSSH `sshd` (and its own mount namespace, so a file may be missing on a host),
//! joined by a management and a data bridge, with different NIC names per host
//! (`scripts/test-cluster.sh`). The launcher runs in the root namespace, which is on the
//! management network only.
//!
//! Building one needs root, `ip`, `unshare` and `sshd`: in CI (`CI` set) or with
//! `INFER_TEST_HARDWARE=1` a missing one fails the test; elsewhere [`TestCluster::start`]
//! returns `None` and the test returns early.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// One host of a test cluster.
pub struct TestHost {
    pub name: String,
    pub namespace: String,
    pub management: String,
    pub data: String,
    pub data_nic: String,
}

/// A test cluster; dropping it stops every sshd and deletes the namespaces and bridges.
pub struct TestCluster {
    id: String,
    pub dir: PathBuf,
    _temp: tempfile::TempDir,
    pub hosts: Vec<TestHost>,
    pub inventory: PathBuf,
}

/// How many clusters this test process has built: part of each one's id.
static CLUSTERS: AtomicU32 = AtomicU32::new(0);

/// The script that builds and removes test clusters.
fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/test-cluster.sh")
}

/// Why this machine cannot build a test cluster, if it cannot.
pub fn missing_requirement() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("the test cluster needs root (network namespaces, sshd)".into());
    }
    for tool in ["/usr/sbin/sshd", "/usr/bin/ssh-keygen"] {
        if !Path::new(tool).exists() {
            return Some(format!(
                "`{tool}` is missing: `apt-get install openssh-server openssh-client`"
            ));
        }
    }
    for tool in ["ip", "unshare"] {
        let found = Command::new(tool).arg("--version").output().is_ok();
        if !found {
            return Some(format!(
                "`{tool}` is missing: `apt-get install iproute2 util-linux`"
            ));
        }
    }
    None
}

impl TestCluster {
    /// Builds a cluster of `n_hosts` hosts with `cpu_ranks` slots each; `None` (the test
    /// returns) where that cannot be done outside CI.
    pub fn start(n_hosts: usize, cpu_ranks: usize) -> Option<TestCluster> {
        TestCluster::start_with(n_hosts, cpu_ranks, None)
    }

    /// [`TestCluster::start`] whose hosts answer `uname -m` with `fake_arch` when given.
    pub fn start_with(
        n_hosts: usize,
        cpu_ranks: usize,
        fake_arch: Option<&str>,
    ) -> Option<TestCluster> {
        TestCluster::start_full(n_hosts, cpu_ranks, fake_arch, None)
    }

    /// [`TestCluster::start_with`] where host `low_nofile_host`'s sshd runs with
    /// `ulimit -n 1024`.
    pub fn start_full(
        n_hosts: usize,
        cpu_ranks: usize,
        fake_arch: Option<&str>,
        low_nofile_host: Option<usize>,
    ) -> Option<TestCluster> {
        TestCluster::start_faulty(n_hosts, cpu_ranks, fake_arch, low_nofile_host, None)
    }

    /// [`TestCluster::start_full`] where `fake_nccl` = (host, library file) becomes that
    /// host's `/usr/local/lib/libnccl.so.2`.
    pub fn start_faulty(
        n_hosts: usize,
        cpu_ranks: usize,
        fake_arch: Option<&str>,
        low_nofile_host: Option<usize>,
        fake_nccl: Option<(usize, &Path)>,
    ) -> Option<TestCluster> {
        if let Some(why) = missing_requirement() {
            let required = std::env::var_os("CI").is_some()
                || std::env::var("INFER_TEST_HARDWARE").is_ok_and(|v| v == "1");
            assert!(!required, "cannot build the SSH test cluster: {why}");
            return None;
        }
        let serial = CLUSTERS.fetch_add(1, Ordering::SeqCst);
        let id = format!("{:03x}{serial}", std::process::id() & 0xfff);
        let octet = 20 + (std::process::id() * 13 + serial * 7) % 200;
        let temp = tempfile::Builder::new()
            .prefix("infer-cluster-")
            .tempdir()
            .expect("temp dir");
        let dir = temp.path().to_path_buf();
        let output = Command::new("bash")
            .arg(script())
            .args(["up", &id, &n_hosts.to_string()])
            .arg(&dir)
            .env("OCTET", octet.to_string())
            .env("FAKE_ARCH", fake_arch.unwrap_or(""))
            .env(
                "LOW_NOFILE_HOST",
                low_nofile_host.map_or("none".to_string(), |h| h.to_string()),
            )
            .env(
                "FAKE_NCCL_HOST",
                fake_nccl.map_or("none".to_string(), |(h, _)| h.to_string()),
            )
            .env(
                "FAKE_NCCL_LIB",
                fake_nccl.map_or(PathBuf::new(), |(_, lib)| lib.to_path_buf()),
            )
            .output()
            .expect("run scripts/test-cluster.sh");
        let mut cluster = TestCluster {
            id,
            dir: dir.clone(),
            _temp: temp,
            hosts: Vec::new(),
            inventory: dir.join("hosts.toml"),
        };
        assert!(
            output.status.success(),
            "test-cluster.sh up failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let listing = std::fs::read_to_string(dir.join("hosts.txt")).expect("hosts.txt");
        for line in listing.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            cluster.hosts.push(TestHost {
                name: fields[0].into(),
                namespace: fields[1].into(),
                management: fields[2].into(),
                data: fields[3].into(),
                data_nic: fields[5].into(),
            });
        }
        if cpu_ranks != 2 {
            let text = std::fs::read_to_string(&cluster.inventory).expect("inventory");
            std::fs::write(
                &cluster.inventory,
                text.replace("cpu-ranks = 2", &format!("cpu-ranks = {cpu_ranks}")),
            )
            .expect("inventory");
        }
        // Wait until every sshd listens.
        for host in &cluster.hosts {
            let address: std::net::SocketAddr =
                format!("{}:22", host.management).parse().expect("address");
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::net::TcpStream::connect_timeout(&address, Duration::from_millis(200))
                .is_err()
            {
                assert!(
                    Instant::now() < deadline,
                    "sshd on {} never listened",
                    host.name
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(cluster)
    }

    /// Adds (`-A`) or deletes (`-D`) an iptables rule in host `host`'s namespace that sends
    /// incoming TCP to `port` to `target` (`DROP`, `REJECT --reject-with tcp-reset`, …).
    pub fn port_rule(&self, host: usize, port: &str, action: &str, target: &[&str]) {
        let status = Command::new("ip")
            .args(["netns", "exec", &self.hosts[host].namespace, "iptables"])
            .args([action, "INPUT", "-p", "tcp", "--dport", port, "-j"])
            .args(target)
            .status()
            .expect("iptables (apt-get install iptables)");
        assert!(status.success(), "iptables {action} {target:?}");
    }

    /// Starts, in host `host`'s namespace, a stranger to the run (a process holding no key)
    /// that opens to each of `addresses` (`ip:port`) 40 idle connections, one of garbage, one
    /// hello of our handshake claiming a 64 KiB channel and one 4 GiB length prefix, and
    /// holds them until the returned guard is dropped. Panics when it cannot connect.
    pub fn strangers(&self, host: usize, addresses: &[&str]) -> Strangers {
        const SCRIPT: &str = r#"
import socket, sys, time
held = []
for address in sys.argv[1:]:
    host, port = address.rsplit(":", 1)
    for _ in range(40):
        held.append(socket.create_connection((host, int(port)), timeout=5))
    for payload in (b"\xff" * 64, b"infer\x00h1" + (65535).to_bytes(2, "little"), (2**32 - 1).to_bytes(4, "little")):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(payload)
        held.append(s)
print("ready", flush=True)
time.sleep(600)
"#;
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.hosts[host].namespace,
                "python3",
                "-c",
                SCRIPT,
            ])
            .args(addresses)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 in the host's namespace");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("stdout");
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)
            .expect("the strangers' line");
        assert_eq!(line.trim(), "ready", "the strangers could not connect");
        Strangers(child)
    }

    /// Starts, in host `host`'s namespace, a stranger to the run (a local process holding no
    /// key) that races the run for every port the host starts listening on (at its data
    /// address or every address; sshd's port aside), as soon as the kernel lists it: to each
    /// it opens 8 idle connections, one of garbage, one hello of our handshake claiming a
    /// 64 KiB channel and one 4 GiB length prefix, and holds them until [`Racer::stop`].
    /// Until it has reached a first port, connections arriving at the host's data interface
    /// are held back (their SYNs dropped: the kernel retries after a second), so the
    /// stranger is first at a listener whose peer would otherwise connect at once.
    pub fn racer(&self, host: usize) -> Racer {
        const SCRIPT: &str = r#"
import socket, subprocess, sys, time
address, nic = sys.argv[1], sys.argv[2]
payloads = [None] * 8 + [b"\xff" * 64, b"infer\x00h1" + (65535).to_bytes(2, "little"), (2**32 - 1).to_bytes(4, "little")]
hold = ["INPUT", "-i", nic, "-p", "tcp", "--syn", "-j", "DROP"]
subprocess.run(["iptables", "-I"] + hold, check=True)
holding = True
mine = socket.inet_aton(address)[::-1].hex().upper()
seen, held = set(), []
print("ready", flush=True)
while True:
    with open("/proc/net/tcp") as table:
        rows = table.read().splitlines()[1:]
    for row in rows:
        local, state = row.split()[1], row.split()[3]
        host, port = local.split(":")
        port = int(port, 16)
        if state != "0A" or port == 22 or port in seen or host not in (mine, "00000000"):
            continue
        seen.add(port)
        try:
            for payload in payloads:
                s = socket.create_connection((address, port), timeout=1)
                if payload:
                    s.sendall(payload)
                held.append(s)
            print("reached", port, flush=True)
            if holding:
                subprocess.run(["iptables", "-D"] + hold, check=True)
                holding = False
        except OSError:
            pass
    time.sleep(0.001)
"#;
        let namespace = &self.hosts[host].namespace;
        let mut child = Command::new("ip")
            .args(["netns", "exec", namespace, "python3", "-c", SCRIPT])
            .args([&self.hosts[host].data, &self.hosts[host].data_nic])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 in the host's namespace");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = std::io::BufReader::new(stdout);
        let mut line = String::new();
        std::io::BufRead::read_line(&mut lines, &mut line).expect("the racer's line");
        assert_eq!(
            line.trim(),
            "ready",
            "the racer could not start (iptables?)"
        );
        Racer {
            child,
            lines,
            namespace: namespace.clone(),
            nic: self.hosts[host].data_nic.clone(),
        }
    }

    /// Trusts every host's key in the inventory's `known_hosts`, as a user would have.
    pub fn trust_hosts(&self) {
        let listing = std::fs::read_to_string(self.dir.join("hosts.txt")).expect("hosts.txt");
        let mut known = String::new();
        for line in listing.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            known.push_str(&format!("{} {} {}\n", fields[2], fields[6], fields[7]));
        }
        std::fs::write(self.dir.join("known_hosts"), known).expect("known_hosts");
    }

    /// Puts the inventory's text through `edit`.
    pub fn edit_inventory(&self, edit: impl FnOnce(String) -> String) {
        let text = std::fs::read_to_string(&self.inventory).expect("inventory");
        std::fs::write(&self.inventory, edit(text)).expect("inventory");
    }

    /// Asserts that host `from` has an established TCP connection between its data address
    /// and host `to`'s (read with `ss` inside `from`'s namespace).
    pub fn assert_data_connection(&self, from: usize, to: usize) {
        let output = Command::new("ip")
            .args(["netns", "exec", &self.hosts[from].namespace])
            .args(["ss", "-tnH", "state", "established"])
            .output()
            .expect("ss");
        let connections = String::from_utf8_lossy(&output.stdout);
        let (mine, theirs) = (
            format!("{}:", self.hosts[from].data),
            format!("{}:", self.hosts[to].data),
        );
        assert!(
            connections
                .lines()
                .any(|l| l.contains(&mine) && l.contains(&theirs)),
            "no connection {mine} <-> {theirs}:\n{connections}"
        );
    }

    /// The established TCP connections of process `pid` in host `host`'s namespace (read
    /// with `ss`), as (local, peer) `ADDRESS:PORT` pairs.
    pub fn connections_of(&self, host: usize, pid: u64) -> Vec<(String, String)> {
        let output = Command::new("ip")
            .args(["netns", "exec", &self.hosts[host].namespace])
            .args(["ss", "-tnpH", "state", "established"])
            .output()
            .expect("ss");
        let owner = format!("pid={pid},");
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|line| line.contains(&owner))
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                Some((fields.get(2)?.to_string(), fields.get(3)?.to_string()))
            })
            .collect()
    }

    /// Black-holes the collective links of rank 1 of the run whose `manifest` is given
    /// (running on host 1): every packet to its connections to its peers (not those to the
    /// store, which carry its heartbeats and wait reports) is dropped. Panics when it has
    /// none.
    pub fn black_hole_rank_1(&self, manifest: &serde_json::Value) {
        let pid = manifest["ranks"][1]["pid"].as_u64().expect("rank 1's pid");
        let store = manifest["store"].as_str().expect("store address");
        let ports: Vec<String> = self
            .connections_of(1, pid)
            .into_iter()
            .filter(|(_, peer)| peer != store)
            .filter_map(|(local, _)| local.rsplit(':').next().map(str::to_string))
            .collect();
        assert!(!ports.is_empty(), "rank 1 is connected to its peers");
        for port in &ports {
            self.port_rule(1, port, "-A", &["DROP"]);
        }
    }

    /// The root-namespace end of a host's management link.
    pub fn management_link(&self, host: usize) -> String {
        format!("v{}h{host}m", self.id)
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .args(["down", &self.id])
            .arg(&self.dir)
            .output();
    }
}

/// Strangers holding connections ([`TestCluster::strangers`]); dropping it kills them.
pub struct Strangers(std::process::Child);

/// A stranger racing a host's new ports ([`TestCluster::racer`]).
pub struct Racer {
    child: std::process::Child,
    lines: std::io::BufReader<std::process::ChildStdout>,
    namespace: String,
    nic: String,
}

impl Racer {
    /// Stops the stranger (and lets connections in, if it reached no port) and returns the
    /// ports it reached (connected to and held).
    pub fn stop(mut self) -> Vec<u16> {
        self.kill();
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut self.lines, &mut rest);
        rest.lines()
            .filter_map(|line| line.strip_prefix("reached ")?.parse().ok())
            .collect()
    }
}

impl Racer {
    /// Kills the stranger and deletes the rule holding connections back, if it is left.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.namespace,
                "iptables",
                "-D",
                "INPUT",
                "-i",
            ])
            .args([&self.nic, "-p", "tcp", "--syn", "-j", "DROP"])
            .output();
    }
}

impl Drop for Racer {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Drop for Strangers {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
