//! `infer topo`: importing the real `nvidia-smi topo -m` fixtures, probing fake sysfs trees
//! and this machine, JSON round trips, and bad input.

use std::collections::HashMap;

use infer::topology::{Gpu, Host, LinkCode, NicKind, P2pStatus, Topology};
use serde_json::Value;

use crate::support::fixtures::{FakePort, FakeSysfs, shared_fixture};
use crate::support::process::{run, run_with_stdin, stdout_ok};

/// Imports a fixture through the real binary's `--json` output.
fn import_fixture(name: &str) -> Host {
    let path = shared_fixture(&format!("topo/{name}"));
    let stdout = stdout_ok(&run(&[
        "topo",
        "--json",
        "--from",
        path.to_str().expect("UTF-8 path"),
    ]));
    let mut topology: Topology = serde_json::from_str(&stdout).expect("`--json` output parses");
    assert_eq!(topology.hosts.len(), 1);
    topology.hosts.remove(0)
}

fn code(host: &Host, i: usize, j: usize) -> String {
    host.gpu_links[i][j].to_string()
}

fn nic<'a>(host: &'a Host, name: &str) -> &'a infer::topology::Nic {
    host.nics
        .iter()
        .find(|n| n.name == name)
        .unwrap_or_else(|| panic!("no NIC `{name}` in {:?}", host.nics))
}

fn codes(links: &[LinkCode]) -> Vec<String> {
    links.iter().map(ToString::to_string).collect()
}

#[test]
fn h20_nvswitch_board_with_nic_legend() {
    let host = import_fixture("h20_sxm8_nv18_mlx5x8_sglang_9696.txt");
    assert_eq!(host.gpus.len(), 8);
    let mut nv18_pairs = 0;
    for i in 0..8 {
        for j in i + 1..8 {
            assert_eq!(code(&host, i, j), "NV18");
            nv18_pairs += 1;
        }
    }
    assert_eq!(nv18_pairs, 28);
    assert_eq!(host.nvlink_domains, vec![(0..8).collect::<Vec<_>>()]);
    // The legend maps NIC0..NIC7 to mlx5_1..mlx5_8: the NIC number is not the mlx5 number.
    let names: Vec<&str> = host.nics.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8"
        ]
    );
    for (rail, nic) in host.nics.iter().enumerate() {
        for gpu in 0..8 {
            let expected = if gpu == rail {
                "PIX"
            } else if (gpu < 4) == (rail < 4) {
                "NODE"
            } else {
                "SYS"
            };
            assert_eq!(
                nic.gpu_links[gpu].to_string(),
                expected,
                "{} ↔ GPU{gpu}",
                nic.name
            );
        }
        assert_eq!(host.nearest_gpus(nic), vec![rail]);
    }
    for gpu in &host.gpus {
        let (numa, cpus) = if gpu.index < 4 {
            (0, "0-47,96-143")
        } else {
            (1, "48-95,144-191")
        };
        assert_eq!(gpu.numa_node, Some(numa));
        assert_eq!(gpu.cpu_affinity.as_deref(), Some(cpus));
    }
    assert!(host.notes.is_empty(), "{:?}", host.notes);
}

#[test]
fn dgx1_v100_hybrid_cube_mesh_old_format() {
    let host = import_fixture("v100_dgx1_nv1nv2_mlx5x4_pytorch_ddp_benchmark_readme.txt");
    assert_eq!(host.gpus.len(), 8);
    let (mut nv_pairs, mut sys_pairs) = (0, 0);
    for i in 0..8 {
        for j in i + 1..8 {
            match host.gpu_links[i][j] {
                LinkCode::NvLink(1 | 2) => nv_pairs += 1,
                LinkCode::Sys => sys_pairs += 1,
                other => panic!("unexpected GPU{i}/GPU{j} code {other}"),
            }
        }
    }
    assert_eq!((nv_pairs, sys_pairs), (16, 12));
    for i in 0..8 {
        let links: u32 = host.gpu_links[i]
            .iter()
            .map(|c| if let LinkCode::NvLink(n) = c { *n } else { 0 })
            .sum();
        assert_eq!(links, 6, "GPU{i} has 6 NVLinks");
    }
    assert_eq!(
        host.nvlink_domains,
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
    );
    // NIC columns keep the header's unsorted order.
    let names: Vec<&str> = host.nics.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["mlx5_2", "mlx5_0", "mlx5_3", "mlx5_1"]);
    assert_eq!(
        codes(&nic(&host, "mlx5_0").gpu_links),
        ["PIX", "PIX", "PHB", "PHB", "SYS", "SYS", "SYS", "SYS"]
    );
    assert_eq!(
        codes(&nic(&host, "mlx5_1").gpu_links),
        ["PHB", "PHB", "PIX", "PIX", "SYS", "SYS", "SYS", "SYS"]
    );
    assert_eq!(host.nearest_gpus(nic(&host, "mlx5_2")), vec![4, 5]);
    assert_eq!(host.nearest_gpus(nic(&host, "mlx5_3")), vec![6, 7]);
    for gpu in &host.gpus {
        assert_eq!(gpu.cpu_affinity.as_deref(), Some("0-19,40-59"));
        assert_eq!(gpu.numa_node, None, "no NUMA Affinity column: unknown");
    }
}

#[test]
fn l40s_without_nvlink_nics_on_one_socket() {
    let host = import_fixture("l40s_x4_node_sys_mlx5x2_missalignment_106.txt");
    assert_eq!(host.gpus.len(), 4);
    assert_eq!(code(&host, 0, 1), "NODE");
    assert_eq!(code(&host, 2, 3), "NODE");
    for (i, j) in [(0, 2), (0, 3), (1, 2), (1, 3)] {
        assert_eq!(code(&host, i, j), "SYS");
    }
    assert!(host.nvlink_domains.iter().all(|d| d.len() == 1));
    for name in ["mlx5_0", "mlx5_1"] {
        assert_eq!(
            codes(&nic(&host, name).gpu_links),
            ["SYS", "SYS", "NODE", "NODE"]
        );
    }
    assert_eq!(host.gpus[0].cpu_affinity.as_deref(), Some("0-95,192-287"));
    assert_eq!(host.gpus[3].cpu_affinity.as_deref(), Some("96-191,288-383"));
    assert_eq!(
        host.gpus.iter().map(|g| g.numa_node).collect::<Vec<_>>(),
        [Some(0), Some(0), Some(1), Some(1)]
    );
}

#[test]
fn a5000_pcie_switches_after_a_shell_prompt() {
    let host = import_fixture("a5000_pcie8_pxb_pix_sys_mlx5x2_tin6150_psg.txt");
    assert_eq!(host.gpus.len(), 8);
    for i in 0..8 {
        for j in i + 1..8 {
            let expected = match (i, j) {
                (2, 3) | (6, 7) => "PIX",
                _ if (i < 4) == (j < 4) => "PXB",
                _ => "SYS",
            };
            assert_eq!(code(&host, i, j), expected, "GPU{i}/GPU{j}");
        }
    }
    assert_eq!(host.nvlink_domains.len(), 8);
    for name in ["mlx5_0", "mlx5_1"] {
        assert_eq!(
            codes(&nic(&host, name).gpu_links),
            ["NODE", "NODE", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
        );
        assert!(
            !nic(&host, name).gpu_links.iter().any(|c| c.allows_gdr()),
            "no GPUDirect RDMA path"
        );
    }
    assert_eq!(host.gpus[0].cpu_affinity.as_deref(), Some("0-15"));
    assert_eq!(host.gpus[7].cpu_affinity.as_deref(), Some("16-31"));
    assert_eq!(host.gpus[7].numa_node, Some(1));
}

#[test]
fn rtx5090_tab_matrix_with_p2p_matrix() {
    let host = import_fixture("rtx5090_x2_phb_p2p_gns_club3090_1229.txt");
    assert_eq!(host.gpus.len(), 2);
    assert_eq!(code(&host, 0, 1), "PHB");
    assert_eq!(host.gpus[0].cpu_affinity.as_deref(), Some("0-63"));
    assert_eq!(host.gpus[1].numa_node, Some(0));
    let p2p = host.p2p.expect("the `topo -p2p rw` matrix is imported");
    assert_eq!(p2p[0][1], P2pStatus::GpuNotSupported);
    assert_eq!(p2p[1][0], P2pStatus::GpuNotSupported);
    assert!(host.nics.is_empty());
}

/// A paste none of the fixtures look like: quoted with `> `, fenced, `collect-env` text with
/// a non-indented header and GPU names, `NV12` pairs, blank CPU affinity cells.
#[test]
fn quoted_collect_env_paste_with_gpu_names() {
    let text = "\
> Collecting environment information...
> GPU models and configuration:
> GPU 0: NVIDIA A100-SXM4-80GB
> GPU 1: NVIDIA A100-SXM4-80GB
>
> ```
> GPU Topology:
> GPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
> GPU0\t X \tNV12\tSYS\t\t1\t\tN/A
> GPU1\tNV12\t X \tSYS\t\t1\t\tN/A
> NIC0\tSYS\tSYS\t X
>
> NIC Legend:
>
>   NIC0: mlx5_bond_0
> ```
";
    let stdout = stdout_ok(&run_with_stdin(
        &["topo", "--json", "--from", "-"],
        text.as_bytes(),
    ));
    let topology: Topology = serde_json::from_str(&stdout).expect("JSON");
    let host = &topology.hosts[0];
    assert_eq!(host.gpus.len(), 2);
    assert_eq!(code(host, 0, 1), "NV12");
    assert_eq!(host.nvlink_domains, vec![vec![0, 1]]);
    assert_eq!(host.gpus[0].name.as_deref(), Some("NVIDIA A100-SXM4-80GB"));
    assert_eq!(host.gpus[1].cpu_affinity, None);
    assert_eq!(host.gpus[1].numa_node, Some(1));
    assert_eq!(host.nics[0].name, "mlx5_bond_0");
    assert_eq!(host.hostname, "stdin");
}

#[test]
fn json_round_trips_through_import() {
    for fixture in [
        "h20_sxm8_nv18_mlx5x8_sglang_9696.txt",
        "rtx5090_x2_phb_p2p_gns_club3090_1229.txt",
    ] {
        let path = shared_fixture(&format!("topo/{fixture}"));
        let first = stdout_ok(&run(&[
            "topo",
            "--json",
            "--from",
            path.to_str().expect("UTF-8"),
        ]));
        let second = stdout_ok(&run_with_stdin(
            &["topo", "--json", "--from", "-"],
            first.as_bytes(),
        ));
        assert_eq!(first, second, "{fixture}");
    }
}

#[test]
fn this_machine_probes_without_a_driver_and_round_trips() {
    let output = run(&["topo"]);
    let text = stdout_ok(&output);
    let has_driver = std::path::Path::new("/proc/driver/nvidia/version").exists();
    if !has_driver {
        assert!(text.contains("no NVIDIA GPUs"), "{text}");
        assert!(text.contains("no NVIDIA driver found"), "{text}");
    }
    let json = stdout_ok(&run(&["topo", "--json"]));
    let topology: Topology = serde_json::from_str(&json).expect("JSON");
    let host = &topology.hosts[0];
    let mut expected: Vec<String> = std::fs::read_dir("/sys/class/net")
        .expect("this machine has /sys/class/net")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    expected.sort();
    let mut netdevs: Vec<String> = host.nics.iter().filter_map(|n| n.netdev.clone()).collect();
    netdevs.sort();
    assert_eq!(netdevs, expected);
    let lo = host
        .nics
        .iter()
        .find(|n| n.name == "lo")
        .expect("loopback is listed");
    assert!(lo.is_virtual);
    assert!(
        lo.addresses.iter().any(|a| a == "127.0.0.1"),
        "{:?}",
        lo.addresses
    );
    // `infer topo --json | infer topo --from -` gives the same topology back.
    let again = stdout_ok(&run_with_stdin(
        &["topo", "--json", "--from", "-"],
        json.as_bytes(),
    ));
    assert_eq!(json, again);
}

fn fake_cluster_node() -> FakeSysfs {
    let sysfs = FakeSysfs::new();
    sysfs.numa_nodes(2);
    // Socket 0: GPU0 and an InfiniBand HCA behind one PCIe switch; a RoCE NIC on another root port.
    sysfs.pci_device(
        "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:00.0/0000:3d:00.0",
        0,
    );
    sysfs.pci_device(
        "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:04.0/0000:3e:00.0",
        0,
    );
    sysfs.pci_device("pci0000:3a/0000:3a:02.0/0000:40:00.0", 0);
    // Socket 1: GPU1, and the Ethernet NIC on a second root complex of the same socket.
    sysfs.pci_device("pci0000:80/0000:80:00.0/0000:81:00.0", 1);
    sysfs.pci_device("pci0000:a0/0000:a0:02.0/0000:a2:00.0", 1);

    sysfs.hca(
        "mlx5_0",
        "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:04.0/0000:3e:00.0",
        &[
            FakePort {
                state: "4: ACTIVE",
                phys_state: "5: LinkUp",
                rate: "400 Gb/sec (4X NDR)",
                link_layer: "InfiniBand",
                gids: &[(0, "fe80:0000:0000:0000:b83f:d203:00a1:2b3c", "IB/RoCE v1")],
            },
            FakePort {
                state: "1: DOWN",
                phys_state: "3: Disabled",
                rate: "10 Gb/sec (4X SDR)",
                link_layer: "InfiniBand",
                gids: &[],
            },
        ],
    );
    sysfs.netdev(
        "ib0",
        Some("pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:04.0/0000:3e:00.0"),
        "up",
        400000,
        32,
    );
    sysfs.hca(
        "mlx5_1",
        "pci0000:3a/0000:3a:02.0/0000:40:00.0",
        &[FakePort {
            state: "4: ACTIVE",
            phys_state: "5: LinkUp",
            rate: "100 Gb/sec (4X EDR)",
            link_layer: "Ethernet",
            gids: &[
                (0, "fe80:0000:0000:0000:0202:c9ff:fe00:0001", "IB/RoCE v1"),
                (3, "0000:0000:0000:0000:0000:ffff:0a00:0002", "RoCE v2"),
            ],
        }],
    );
    sysfs.netdev(
        "ens1f0np0",
        Some("pci0000:3a/0000:3a:02.0/0000:40:00.0"),
        "up",
        100000,
        1,
    );
    sysfs.netdev(
        "eno1",
        Some("pci0000:a0/0000:a0:02.0/0000:a2:00.0"),
        "up",
        25000,
        1,
    );
    sysfs.netdev("lo", None, "unknown", -1, 772);
    sysfs.netdev("veth1a2b", None, "up", 10000, 1);
    sysfs.netdev("tailscale0", None, "unknown", -1, 65534);
    sysfs.netdev("br-lan", None, "up", -1, 1);
    sysfs.bridge("docker0", &["veth1a2b"]);
    sysfs.bridge("vmbr0", &["eno1"]);
    sysfs
}

#[test]
fn fake_sysfs_interfaces_and_hcas() {
    let sysfs = fake_cluster_node();
    let root = sysfs.root().to_str().expect("UTF-8").to_string();
    let stdout = stdout_ok(&run(&["topo", "--json", "--sysfs-root", &root]));
    let value: Value = serde_json::from_str(&stdout).expect("JSON");
    let topology: Topology = serde_json::from_value(value.clone()).expect("schema");
    let host = &topology.hosts[0];

    let ib = nic(host, "mlx5_0");
    assert_eq!(ib.kind, NicKind::Ib);
    assert_eq!(ib.netdev.as_deref(), Some("ib0"));
    assert_eq!(ib.state.as_deref(), Some("ACTIVE"));
    assert_eq!(ib.rate_gbps, Some(400.0));
    assert_eq!(ib.ports.len(), 2);
    assert_eq!(
        (ib.ports[1].state.as_str(), ib.ports[1].phys_state.as_str()),
        ("DOWN", "Disabled")
    );
    assert_eq!(ib.ports[0].gids.len(), 1, "zero GIDs are skipped");
    assert_eq!(ib.pci_bus_id.as_deref(), Some("0000:3e:00.0"));
    assert_eq!(ib.numa_node, Some(0));
    assert!(!ib.is_virtual);

    let roce = nic(host, "mlx5_1");
    assert_eq!(roce.kind, NicKind::Roce);
    assert_eq!(roce.netdev.as_deref(), Some("ens1f0np0"));
    assert_eq!(roce.ports[0].gids[1].index, 3);
    assert_eq!(roce.ports[0].gids[1].gid_type.as_deref(), Some("RoCE v2"));
    assert_eq!(roce.mtu_bytes, Some(1500));

    // Netdevs of HCAs are folded into them, not listed twice.
    assert!(
        host.nics
            .iter()
            .all(|n| n.name != "ib0" && n.name != "ens1f0np0")
    );
    let eth = nic(host, "eno1");
    assert_eq!(eth.kind, NicKind::Eth);
    assert_eq!(eth.rate_gbps, Some(25.0));
    assert_eq!(eth.state.as_deref(), Some("up"));
    assert!(!eth.is_virtual);
    for name in ["lo", "veth1a2b", "tailscale0", "docker0", "vmbr0", "br-lan"] {
        assert!(nic(host, name).is_virtual, "{name} is virtual");
        assert_eq!(nic(host, name).pci_bus_id, None);
    }
    assert!(
        host.gpus.is_empty(),
        "NVML is not available on the test machine"
    );
    // The human output lists every NIC too.
    let text = stdout_ok(&run(&["topo", "--sysfs-root", &root]));
    for name in ["mlx5_0", "mlx5_1", "eno1", "docker0", "tailscale0"] {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
}

#[test]
fn fake_sysfs_nic_to_gpu_distances() {
    let sysfs = fake_cluster_node();
    let gpu = |index: usize, bus_id: &str, numa_node: u32| Gpu {
        index,
        name: None,
        uuid: None,
        memory_bytes: None,
        pci_bus_id: Some(bus_id.to_string()),
        numa_node: Some(numa_node),
        cpu_affinity: None,
        nvlinks_active: None,
        nvlinks_inactive: None,
    };
    let gpus = [gpu(0, "0000:3d:00.0", 0), gpu(1, "0000:81:00.0", 1)];
    let addresses = HashMap::from([("eno1".to_string(), vec!["10.0.0.5".to_string()])]);
    let nics = infer::topology::sysfs::probe_nics(sysfs.root(), &gpus, &addresses).expect("probe");
    let by_name = |name: &str| nics.iter().find(|n| n.name == name).expect("present");
    // Same PCIe switch as GPU0: GPUDirect RDMA distance.
    assert_eq!(codes(&by_name("mlx5_0").gpu_links), ["PIX", "SYS"]);
    // Another root port of the same root complex: through the host bridge.
    assert_eq!(codes(&by_name("mlx5_1").gpu_links), ["PHB", "SYS"]);
    // Socket 1, another root complex: NODE to GPU1, SYS to GPU0.
    assert_eq!(codes(&by_name("eno1").gpu_links), ["SYS", "NODE"]);
    assert_eq!(by_name("eno1").addresses, ["10.0.0.5"]);
    assert!(by_name("docker0").gpu_links.is_empty());
}

fn write_temp(contents: &str) -> tempfile::NamedTempFile {
    use std::io::Write;
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(contents.as_bytes()).expect("write");
    file
}

fn import_error(contents: &str) -> String {
    let file = write_temp(contents);
    let output = run(&["topo", "--from", file.path().to_str().expect("UTF-8")]);
    assert_eq!(output.status.code(), Some(2), "bad input exits 2");
    assert!(output.stdout.is_empty(), "nothing on stdout for bad input");
    String::from_utf8(output.stderr).expect("UTF-8")
}

#[test]
fn not_a_topology_is_rejected() {
    let stderr = import_error(
        "Fri Nov 21 12:00:00 2026\n+-----------------------------------------+\n| NVIDIA-SMI 550.54.15 |\n",
    );
    assert!(
        stderr.contains("is not `nvidia-smi topo -m` output"),
        "{stderr}"
    );
    assert!(stderr.contains("hint:"), "{stderr}");
}

#[test]
fn ragged_matrix_names_the_line() {
    let stderr = import_error(
        "\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tNV1\tNV1\t0-7\nGPU1\tNV1\t X \t0-7\nGPU2\tNV1\tNV1\t X \t0-7\n",
    );
    assert!(stderr.contains("line 3"), "{stderr}");
    assert!(
        stderr.contains("row `GPU1` has 2 link cells, expected 3"),
        "{stderr}"
    );
    let stderr =
        import_error("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV1\tSYS\t0-7\nGPU1\tNV1\t X \t0-7\n");
    assert!(stderr.contains("line 2"), "{stderr}");
    assert!(stderr.contains("ragged"), "{stderr}");
}

#[test]
fn unknown_code_names_the_line_and_cell() {
    let stderr = import_error("# pasted\n\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNVL4\t X \n");
    assert!(stderr.contains("line 4"), "{stderr}");
    assert!(
        stderr.contains("cell `GPU0` of row `GPU1` is `NVL4`"),
        "{stderr}"
    );
}

#[test]
fn missing_gpu_row_and_asymmetry_are_rejected() {
    let stderr = import_error("\tGPU0\tGPU1\tGPU2\nGPU0\t X \tPIX\tPIX\nGPU1\tPIX\t X \tPIX\n");
    assert!(stderr.contains("no row for `GPU2`"), "{stderr}");
    let stderr = import_error("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tSYS\t X \n");
    assert!(stderr.contains("symmetric"), "{stderr}");
}

#[test]
fn inconsistent_json_is_rejected() {
    let stderr = import_error(
        r#"{"hosts":[{"hostname":"a","source":"json","gpus":[],"gpu_links":[["X"]],"nvlink_domains":[],"nics":[]}]}"#,
    );
    assert!(stderr.contains("0 GPUs but 1 rows"), "{stderr}");
    let stderr = import_error(r#"{"hosts": 3}"#);
    assert!(stderr.contains("looks like JSON"), "{stderr}");
}

#[test]
fn missing_file_is_a_clear_error() {
    let output = run(&["topo", "--from", "/nonexistent/topo.txt"]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("failed to read `/nonexistent/topo.txt`"),
        "{stderr}"
    );
}

#[test]
fn text_output_of_an_import() {
    let path = shared_fixture("topo/l40s_x4_node_sys_mlx5x2_missalignment_106.txt");
    let stdout = stdout_ok(&run(&["topo", "--from", path.to_str().expect("UTF-8")]));
    insta::assert_snapshot!(stdout);
}
