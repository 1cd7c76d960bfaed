//! How the launcher reaches an inventory's hosts and how they reach each other: SSH targets
//! (inventory, then `~/.ssh/config`, then OpenSSH's defaults), and each host's data
//! interface, chosen from its own interfaces (the inventory's override, else the network
//! every host shares that is not the SSH one).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::Progress;
use super::remote::{RemoteCluster, RemoteHostSpec};
use super::ssh::{SshTarget, default_identity_files, default_known_hosts};
use super::ssh_config;
use crate::inventory::InventoryEntry;
use crate::topology::Interface;

/// One host's choice of data network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DataInterface {
    /// Interface name on that host.
    pub name: String,
    /// Its IPv4 address on the data network.
    pub address: Ipv4Addr,
}

/// Each host's data interface (the inventory's `nccl-socket-ifname`, else the network every
/// host shares that is not the SSH one), checked up, and reported through `progress`.
///
/// Errors: no common network, an interface that is down.
pub(crate) fn data_interfaces(
    remote: &RemoteCluster,
    entries: &[InventoryEntry],
    targets: &[RemoteHostSpec],
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<DataInterface>> {
    // The SSH address is what the host was connected at (after `~/.ssh/config`'s HostName).
    let hellos: Vec<(&[Interface], Option<&str>, Option<&str>)> = remote
        .hosts
        .iter()
        .zip(entries)
        .zip(targets)
        .map(|((host, entry), target)| {
            (
                &host.hello.interfaces[..],
                entry.nccl_socket_ifname.as_deref(),
                Some(target.target.address.as_str()),
            )
        })
        .collect();
    let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    let data = choose_data_interfaces(&names, &hellos)?;
    for ((host, entry), interface) in remote.hosts.iter().zip(entries).zip(&data) {
        if let Some(found) = host
            .hello
            .interfaces
            .iter()
            .find(|i| i.name == interface.name)
            && !found.up
        {
            bail!(
                "data interface `{}` ({}) is down on `{}`\nhint: `ip link set dev {} up` there, or check its cable and switch port",
                interface.name,
                interface.address,
                entry.name,
                interface.name
            );
        }
    }
    for (entry, interface) in entries.iter().zip(&data) {
        progress(Progress::Host {
            host: entry.name.clone(),
            stage: format!("data interface `{}` {}", interface.name, interface.address),
        });
    }
    Ok(data)
}

/// One IPv4 address of a host: interface name, address, prefix length, whether the
/// interface is virtual.
type HostAddress = (String, Ipv4Addr, u8, bool);

/// The IPv4 network (masked address, prefix length) of `ip` with `prefix`.
fn network_of(ip: Ipv4Addr, prefix: u8) -> (u32, u8) {
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    (u32::from(ip) & mask, prefix)
}

/// The interface every host's collectives use: the inventory's `nccl-socket-ifname` where
/// given, else an interface on an IPv4 network every host has an address in, preferring a
/// network that does not carry the SSH (management) addresses, then physical interfaces.
/// Each host keeps its own interface name (`data0` on one, `ens5` on another).
///
/// `hosts[i]` is (interfaces, override, SSH address) of host `names[i]`.
///
/// Interfaces that are down count (the caller reports them): a data NIC that lost its link
/// must not be silently replaced by the management network.
///
/// Errors: an override naming an interface that is missing or without IPv4 on that host
/// (listing what it has); no network common to all hosts.
pub(crate) fn choose_data_interfaces(
    names: &[&str],
    hosts: &[(&[Interface], Option<&str>, Option<&str>)],
) -> Result<Vec<DataInterface>> {
    let parsed: Vec<Vec<HostAddress>> = hosts
        .iter()
        .map(|(interfaces, ..)| host_addresses(interfaces))
        .collect();
    // Overrides first: they must exist on their host.
    let chosen = chosen_overrides(names, hosts, &parsed)?;
    if chosen.iter().all(Option::is_some) {
        return Ok(chosen.into_iter().flatten().collect());
    }
    let ssh_addresses: Vec<Ipv4Addr> = hosts
        .iter()
        .filter_map(|(_, _, a)| a.as_ref()?.parse().ok())
        .collect();
    let candidates = common_networks(&parsed, &chosen, &ssh_addresses);
    let Some(best) = candidates.first() else {
        if hosts.len() == 1 {
            // One host: any of its addresses, the SSH one last.
            let ssh = ssh_addresses.first();
            if let Some((name, ip, ..)) = parsed[0]
                .iter()
                .min_by_key(|(_, ip, _, v)| (Some(ip) == ssh, *v))
            {
                return Ok(vec![DataInterface {
                    name: name.clone(),
                    address: *ip,
                }]);
            }
        }
        bail!(
            "no IPv4 network reaches every host ({}); name each host's data interface with `nccl-socket-ifname` in the inventory",
            names.join(", ")
        );
    };
    Ok(parsed
        .iter()
        .zip(chosen)
        .map(|(interfaces, fixed)| {
            fixed.unwrap_or_else(|| {
                let (name, ip, ..) = interfaces
                    .iter()
                    .find(|(_, ip, p, _)| network_of(*ip, *p) == *best)
                    .expect("every host has an address on the chosen network");
                DataInterface {
                    name: name.clone(),
                    address: *ip,
                }
            })
        })
        .collect())
}

/// Every IPv4 address of `interfaces` but the loopback's (down interfaces included).
fn host_addresses(interfaces: &[Interface]) -> Vec<HostAddress> {
    interfaces
        .iter()
        // Down interfaces count too: a data NIC that is down must be reported as
        // such, not silently replaced by the management network.
        .filter(|i| i.name != "lo")
        .flat_map(|i| {
            i.ipv4.iter().filter_map(move |cidr| {
                let (ip, prefix) = cidr.split_once('/')?;
                let ip: Ipv4Addr = ip.parse().ok()?;
                let prefix: u8 = prefix.parse().ok().filter(|p| *p <= 32)?;
                (!ip.is_loopback()).then(|| (i.name.clone(), ip, prefix, i.is_virtual))
            })
        })
        .collect()
}

/// Each host's data interface as its override (`nccl-socket-ifname`) names it; `None`
/// where it has none. `parsed[i]`: host `i`'s addresses.
///
/// Errors: an override naming an interface that is missing or without IPv4 on its host,
/// listing what the host has.
fn chosen_overrides(
    names: &[&str],
    hosts: &[(&[Interface], Option<&str>, Option<&str>)],
    parsed: &[Vec<HostAddress>],
) -> Result<Vec<Option<DataInterface>>> {
    let mut chosen: Vec<Option<DataInterface>> = vec![None; hosts.len()];
    for (index, (interfaces, wanted, _)) in hosts.iter().enumerate() {
        let Some(wanted) = wanted else { continue };
        match parsed[index].iter().find(|(name, ..)| name == wanted) {
            Some((name, ip, ..)) => {
                chosen[index] = Some(DataInterface {
                    name: name.clone(),
                    address: *ip,
                })
            }
            None => {
                let has: Vec<String> = interfaces
                    .iter()
                    .map(|i| {
                        format!(
                            "{} ({})",
                            i.name,
                            if i.up {
                                i.ipv4.join(" ")
                            } else {
                                "down".into()
                            }
                        )
                    })
                    .collect();
                bail!(
                    "interface `{wanted}` (nccl-socket-ifname) is missing, down or has no IPv4 address on `{}`; it has: {}",
                    names[index],
                    has.join(", ")
                );
            }
        }
    }
    Ok(chosen)
}

/// The networks (masked address, prefix length) every host has an address in (a host with
/// an override: that address), best first: not the SSH addresses' (`ssh_addresses`), then
/// with the fewest virtual interfaces.
fn common_networks(
    parsed: &[Vec<HostAddress>],
    chosen: &[Option<DataInterface>],
    ssh_addresses: &[Ipv4Addr],
) -> Vec<(u32, u8)> {
    let mut candidates: Vec<(u32, u8)> = parsed
        .first()
        .map(|first| {
            first
                .iter()
                .map(|(_, ip, p, _)| network_of(*ip, *p))
                .collect()
        })
        .unwrap_or_default();
    candidates.sort();
    candidates.dedup();
    candidates.retain(|net| {
        parsed
            .iter()
            .enumerate()
            .all(|(index, interfaces)| match &chosen[index] {
                Some(fixed) => network_of(fixed.address, net.1) == *net,
                None => interfaces
                    .iter()
                    .any(|(_, ip, p, _)| network_of(*ip, *p) == *net),
            })
    });
    let score = |net: &(u32, u8)| {
        let management = ssh_addresses.iter().any(|a| network_of(*a, net.1) == *net);
        let virtual_count = parsed
            .iter()
            .flatten()
            .filter(|(_, ip, p, v)| *v && network_of(*ip, *p) == *net)
            .count();
        (management, virtual_count)
    };
    candidates.sort_by_key(score);
    candidates
}

/// SSH targets of the inventory's hosts: the inventory's values, then `~/.ssh/config`'s
/// (`HostName`, `User`, `Port`, `IdentityFile`, `ProxyJump`), then OpenSSH's defaults.
///
/// Errors: an unreadable `~/.ssh/config` (a missing one is fine).
pub(crate) fn ssh_targets(entries: &[InventoryEntry]) -> Result<Vec<RemoteHostSpec>> {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let config_path = home.join(".ssh/config");
    let config_text = match std::fs::read_to_string(&config_path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(error) => {
            return Err(error).with_context(|| format!("cannot read `{}`", config_path.display()));
        }
    };
    let local_user = std::env::var("USER").unwrap_or_else(|_| "root".into());
    entries
        .iter()
        .map(|entry| {
            let config = ssh_config::lookup(&config_text, &entry.address, &home);
            let target = target_from(
                &entry.name,
                &entry.address,
                entry.port,
                entry.user.clone(),
                entry.identity_file.clone(),
                entry.known_hosts.clone(),
                &config,
                &local_user,
                &home,
            );
            let jump = match &config.proxy_jump {
                Some(spec) => {
                    let (user, host, port) = ssh_config::parse_jump(spec);
                    let jump_config = ssh_config::lookup(&config_text, &host, &home);
                    // The bastion is offered the host's identity file too.
                    Some(Box::new(target_from(
                        &host,
                        &host,
                        port,
                        user,
                        entry.identity_file.clone(),
                        entry.known_hosts.clone(),
                        &jump_config,
                        &local_user,
                        &home,
                    )))
                }
                None => None,
            };
            Ok(RemoteHostSpec {
                target: SshTarget { jump, ..target },
                infer_path: entry.infer_path.clone(),
            })
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn target_from(
    name: &str,
    alias: &str,
    port: Option<u16>,
    user: Option<String>,
    identity_file: Option<PathBuf>,
    known_hosts: Option<PathBuf>,
    config: &ssh_config::HostConfig,
    local_user: &str,
    home: &Path,
) -> SshTarget {
    let mut identity_files: Vec<PathBuf> = identity_file.into_iter().collect();
    identity_files.extend(config.identity_files.iter().cloned());
    if identity_files.is_empty() {
        identity_files = default_identity_files(home);
    }
    let mut known: Vec<PathBuf> = known_hosts.into_iter().collect();
    known.push(default_known_hosts(home));
    SshTarget {
        name: name.into(),
        address: config.hostname.clone().unwrap_or_else(|| alias.into()),
        port: port.or(config.port).unwrap_or(22),
        user: user
            .or_else(|| config.user.clone())
            .unwrap_or_else(|| local_user.into()),
        identity_files,
        known_hosts: known,
        jump: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interface(name: &str, cidr: &str, is_virtual: bool) -> Interface {
        Interface {
            name: name.into(),
            ipv4: vec![cidr.into()],
            up: true,
            is_virtual,
            mtu_bytes: Some(1500),
        }
    }

    #[test]
    fn the_data_network_is_the_shared_one_that_is_not_management() {
        let h0 = [
            interface("lo", "127.0.0.1/8", true),
            interface("eno1", "10.1.1.10/24", false),
            interface("data0", "10.1.2.10/24", false),
        ];
        let h1 = [
            interface("eth0", "10.1.1.11/24", false),
            interface("ens5", "10.1.2.11/24", false),
            interface("docker0", "172.17.0.1/16", true),
        ];
        let chosen = choose_data_interfaces(
            &["h0", "h1"],
            &[
                (&h0, None, Some("10.1.1.10")),
                (&h1, None, Some("10.1.1.11")),
            ],
        )
        .expect("chosen");
        assert_eq!(
            chosen,
            vec![
                DataInterface {
                    name: "data0".into(),
                    address: "10.1.2.10".parse().unwrap()
                },
                DataInterface {
                    name: "ens5".into(),
                    address: "10.1.2.11".parse().unwrap()
                },
            ]
        );
        // An override wins, and a missing one is named with what the host has.
        let chosen = choose_data_interfaces(
            &["h0", "h1"],
            &[
                (&h0, Some("eno1"), Some("10.1.1.10")),
                (&h1, None, Some("10.1.1.11")),
            ],
        )
        .expect("chosen");
        assert_eq!(chosen[1].name, "eth0");
        let error = choose_data_interfaces(
            &["h0", "h1"],
            &[(&h0, None, None), (&h1, Some("ib0"), None)],
        )
        .expect_err("missing");
        assert!(
            error.to_string().contains("`ib0`") && error.to_string().contains("`h1`"),
            "{error}"
        );
        // No common network.
        let h2 = [interface("eth0", "192.168.9.2/24", false)];
        let error = choose_data_interfaces(&["h0", "h2"], &[(&h0, None, None), (&h2, None, None)])
            .expect_err("nothing shared");
        assert!(error.to_string().contains("nccl-socket-ifname"), "{error}");
    }
}
