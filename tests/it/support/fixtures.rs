//! The inputs the topology, doctor and plan tests read: the repository's shared fixtures
//! (`../shared/fixtures/`, real-world files with expected facts) and fake sysfs trees with
//! the real layout: `devices/pci…/<bdf>/net/<if>`, `class/net/<if>` links,
//! `class/infiniband/<hca>` links with `device` and `ports/<n>/…`, `bus/pci/devices/<bdf>`
//! links, and `devices/virtual/net/<if>` for software interfaces.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// The path of `relative` in the repository's `../shared/fixtures/` directory; panics,
/// naming it, when the file is missing.
pub fn shared_fixture(relative: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures")
        .join(relative);
    assert!(
        path.exists(),
        "fixture `{}` is missing: is `../shared` checked out beside the repo?",
        path.display()
    );
    path
}

/// A sysfs tree in a temp dir; pass [`FakeSysfs::root`] as `--sysfs-root`.
pub struct FakeSysfs {
    dir: tempfile::TempDir,
}

/// One port of a fake HCA.
pub struct FakePort<'a> {
    pub state: &'a str,
    pub phys_state: &'a str,
    pub rate: &'a str,
    pub link_layer: &'a str,
    /// `(index, gid, type)`.
    pub gids: &'a [(u32, &'a str, &'a str)],
}

impl FakeSysfs {
    /// An empty tree in a new temp dir (deleted when dropped).
    pub fn new() -> FakeSysfs {
        FakeSysfs {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    /// The tree's root directory.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// Writes `contents` and a newline to `relative`, creating its directories.
    fn write(&self, relative: impl AsRef<Path>, contents: &str) {
        let path = self.root().join(relative);
        fs::create_dir_all(path.parent().expect("has parent")).expect("mkdir");
        fs::write(path, format!("{contents}\n")).expect("write");
    }

    /// Makes `relative` a symlink to `target`, creating its directories.
    fn link(&self, relative: impl AsRef<Path>, target: &Path) {
        let path = self.root().join(relative);
        fs::create_dir_all(path.parent().expect("has parent")).expect("mkdir");
        symlink(target, path).expect("symlink");
    }

    /// A PCI device at `pci_path` (`pci0000:3a/0000:3a:00.0/0000:3b:00.0`) on `numa_node`.
    pub fn pci_device(&self, pci_path: &str, numa_node: i32) -> PathBuf {
        let device = self.root().join("devices").join(pci_path);
        fs::create_dir_all(&device).expect("mkdir");
        self.write(device.join("numa_node"), &numa_node.to_string());
        let bdf = pci_path.rsplit('/').next().expect("non-empty path");
        self.link(Path::new("bus/pci/devices").join(bdf), &device);
        device
    }

    /// A network interface. `pci_path` `None` makes it a software interface under `devices/virtual`.
    pub fn netdev(
        &self,
        name: &str,
        pci_path: Option<&str>,
        operstate: &str,
        speed_mbps: i64,
        arphrd_type: u32,
    ) -> PathBuf {
        let dir = match pci_path {
            Some(pci_path) => {
                let device = self.root().join("devices").join(pci_path);
                let dir = device.join("net").join(name);
                fs::create_dir_all(&dir).expect("mkdir");
                symlink(&device, dir.join("device")).expect("symlink");
                dir
            }
            None => self.root().join("devices/virtual/net").join(name),
        };
        self.write(dir.join("operstate"), operstate);
        self.write(dir.join("speed"), &speed_mbps.to_string());
        self.write(dir.join("mtu"), "1500");
        self.write(dir.join("address"), "02:00:00:00:00:01");
        self.write(dir.join("type"), &arphrd_type.to_string());
        self.link(Path::new("class/net").join(name), &dir);
        dir
    }

    /// A Linux bridge (software) with `members` enslaved.
    pub fn bridge(&self, name: &str, members: &[&str]) {
        let dir = self.netdev(name, None, "up", -1, 1);
        fs::create_dir_all(dir.join("bridge")).expect("mkdir");
        for member in members {
            symlink(
                self.root().join("class/net").join(member),
                dir.join(format!("lower_{member}")),
            )
            .expect("symlink");
        }
    }

    /// An RDMA device on the PCI device at `pci_path`.
    pub fn hca(&self, name: &str, pci_path: &str, ports: &[FakePort<'_>]) {
        let device = self.root().join("devices").join(pci_path);
        let dir = device.join("infiniband").join(name);
        fs::create_dir_all(&dir).expect("mkdir");
        symlink(&device, dir.join("device")).expect("symlink");
        for (i, port) in ports.iter().enumerate() {
            let port_dir = dir.join("ports").join((i + 1).to_string());
            self.write(port_dir.join("state"), port.state);
            self.write(port_dir.join("phys_state"), port.phys_state);
            self.write(port_dir.join("rate"), port.rate);
            self.write(port_dir.join("link_layer"), port.link_layer);
            for (index, gid, gid_type) in port.gids {
                self.write(port_dir.join("gids").join(index.to_string()), gid);
                self.write(
                    port_dir.join("gid_attrs/types").join(index.to_string()),
                    gid_type,
                );
            }
            // Unused table entries read as zero GIDs.
            self.write(
                port_dir.join("gids/99"),
                "0000:0000:0000:0000:0000:0000:0000:0000",
            );
        }
        self.link(Path::new("class/infiniband").join(name), &dir);
    }

    /// Declares `n` NUMA nodes.
    pub fn numa_nodes(&self, n: usize) {
        for node in 0..n {
            fs::create_dir_all(self.root().join(format!("devices/system/node/node{node}")))
                .expect("mkdir");
        }
    }
}
