//! Per-host credentials of a run: what each process holds to prove itself on the run's
//! internal connections ([`crate::handshake`]), derived by the launcher from the run's
//! secret so that a host can authenticate only as itself.
//!
//! The launcher draws a 128-bit secret per gang start and derives, with HMAC-SHA256
//! (RFC 2104) keyed by it over a label and host indices:
//! - a **pair key** `P(a, b) = P(b, a)` for every two hosts `a`, `b` of the run (also
//!   `P(a, a)`): the collectives, the DP router links and the KV inboxes between a rank on
//!   host `a` and one on host `b` prove it;
//! - a **store key** `T(h)` per host, and one for the launcher: connections to the
//!   rendezvous store prove it, and the store knows from it which host speaks.
//!
//! A rank's process gets its host's keys only (`P(h, ·)` and `T(h)`), with the host of
//! every rank, in [`crate::envvars::RUN_KEYS`]. A compromised host therefore proves only its
//! own identity: it cannot take another host's rank slot, answer for another host's ranks,
//! or write another host's store keys ([`crate::rendezvous`] checks key ownership). Where no
//! launcher derives keys (`--nnodes`, every node given the same `INFER_RUN_TOKEN`), every
//! process holds the secret itself and no host is kept from acting as another.

use std::net::IpAddr;

use anyhow::{Context, Result, bail};
use hmac::{KeyInit, Mac};
use serde::{Deserialize, Serialize};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// The host index that stands for the launcher in store keys (no inventory host has it).
pub const LAUNCHER_HOST: u32 = u32::MAX;

/// One 256-bit key. Its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Key(pub(crate) [u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(…)")
    }
}

impl Key {
    /// The key's bytes (an HMAC key).
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The key everyone who holds `secret` derives for `purpose` (a secret shared by every
    /// party, as a survey's probes share one): `HMAC-SHA256(secret, purpose ‖ 0 ‖ 0)`.
    pub fn shared(secret: &str, purpose: &str) -> Key {
        derive(secret.as_bytes(), purpose, 0, 0)
    }

    fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn from_hex(text: &str) -> Result<Key> {
        if text.len() != 64 || !text.is_ascii() {
            bail!("a key is 64 hex digits");
        }
        let mut bytes = [0u8; 32];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).context("not hex")?;
        }
        Ok(Key(bytes))
    }
}

/// What a process holds: its host, the host of every rank, and the keys it may use.
#[derive(Clone, Debug)]
pub struct Keyring {
    /// This process's host: an index into the run's hosts (0 on one host), or
    /// [`LAUNCHER_HOST`] for the launcher.
    host: u32,
    /// `rank_hosts[rank]`: the host index of each rank of the world.
    rank_hosts: Vec<u32>,
    /// Hosts of the run (those without ranks included: an agent that only watches).
    hosts: u32,
    /// `addresses[host]`: each host's data address, where the launcher knows them (a
    /// cluster run; empty otherwise). A peer that proves a host's key must come from it.
    addresses: Vec<IpAddr>,
    secrets: Secrets,
}

#[derive(Clone)]
enum Secrets {
    /// The run's secret: derives every key (the launcher; nodes of a `--nnodes` run).
    Master(Vec<u8>),
    /// One host's keys: `pairs[b] = P(host, b)` for every host `b`, and `T(host)`.
    Host { store: Key, pairs: Vec<Key> },
    /// A rendezvous store's keys, held by the host that serves it: `T(h)` for every host
    /// and the launcher's.
    Store { hosts: Vec<Key>, launcher: Key },
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Secrets::Master(_) => "Master(…)",
            Secrets::Host { .. } => "Host(…)",
            Secrets::Store { .. } => "Store(…)",
        })
    }
}

/// How a [`Keyring`] of one host or of a store travels (the environment, an agent frame).
#[derive(Serialize, Deserialize)]
struct Wire {
    host: u32,
    rank_hosts: Vec<u32>,
    hosts: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    addresses: Vec<IpAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    store: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pairs: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    store_hosts: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    store_launcher: Option<String>,
}

/// `HMAC-SHA256(secret, label ‖ a ‖ b)` with `a`, `b` little-endian `u32`s.
fn derive(secret: &[u8], label: &str, a: u32, b: u32) -> Key {
    let mut mac = HmacSha256::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    mac.update(&(label.len() as u64).to_le_bytes());
    mac.update(label.as_bytes());
    mac.update(&a.to_le_bytes());
    mac.update(&b.to_le_bytes());
    Key(mac.finalize().into_bytes().into())
}

fn pair(secret: &[u8], a: u32, b: u32) -> Key {
    derive(secret, "infer pair key", a.min(b), a.max(b))
}

fn store(secret: &[u8], host: u32) -> Key {
    derive(secret, "infer store key", host, 0)
}

impl Keyring {
    /// The keyring of a process that holds the run's `secret` itself, on `host`, with the
    /// host of each rank (`rank_hosts[rank]`).
    pub fn master(secret: &str, host: u32, rank_hosts: Vec<u32>) -> Keyring {
        let hosts = rank_hosts.iter().copied().max().map_or(1, |h| h + 1);
        Keyring {
            host,
            rank_hosts,
            hosts,
            addresses: Vec::new(),
            secrets: Secrets::Master(secret.as_bytes().to_vec()),
        }
    }

    /// The same keyring with each host's data address (`addresses[host]`), which every
    /// keyring derived from it carries: connections then leave from their host's address,
    /// and a peer is accepted only from the address of the host whose key it proved.
    pub fn with_addresses(mut self, addresses: Vec<IpAddr>) -> Keyring {
        self.addresses = addresses;
        self
    }

    /// The data address of the host `rank` is placed on, where the run knows it.
    pub fn address_of_rank(&self, rank: u64) -> Option<IpAddr> {
        self.addresses
            .get(self.host_of_rank(rank)? as usize)
            .copied()
    }

    /// This host's data address, where the run knows it: where its connections leave from.
    pub fn own_address(&self) -> Option<IpAddr> {
        self.addresses.get(self.host as usize).copied()
    }

    /// The same keyring for a run of at least `hosts` hosts (some may run no rank).
    pub fn with_hosts(mut self, hosts: usize) -> Keyring {
        self.hosts = self.hosts.max(u32::try_from(hosts).unwrap_or(u32::MAX));
        self
    }

    /// The same keys, seen from `host` (a master keyring only: the others are one host's).
    pub fn on_host(&self, host: u32) -> Keyring {
        Keyring {
            host,
            ..self.clone()
        }
    }

    /// This process's host index ([`LAUNCHER_HOST`] for the launcher).
    pub fn host(&self) -> u32 {
        self.host
    }

    /// Number of hosts of the run.
    fn host_count(&self) -> u32 {
        self.hosts
    }

    /// The host of `rank`; `None` for a rank outside the world.
    pub fn host_of_rank(&self, rank: u64) -> Option<u32> {
        self.rank_hosts.get(usize::try_from(rank).ok()?).copied()
    }

    /// Ranks in the world.
    pub fn world_size(&self) -> usize {
        self.rank_hosts.len()
    }

    /// Host `host`'s keyring: `P(host, ·)`, `T(host)` and the rank hosts, for its ranks
    /// and agent. Errors: this keyring does not hold the run's secret.
    pub fn for_host(&self, host: u32) -> Result<Keyring> {
        let Secrets::Master(secret) = &self.secrets else {
            bail!("only the run's secret derives another host's keys");
        };
        Ok(Keyring {
            host,
            rank_hosts: self.rank_hosts.clone(),
            hosts: self.hosts,
            addresses: self.addresses.clone(),
            secrets: Secrets::Host {
                store: store(secret, host),
                pairs: (0..self.host_count())
                    .map(|b| pair(secret, host, b))
                    .collect(),
            },
        })
    }

    /// The keys a rendezvous store needs (every host's and the launcher's store key), for a
    /// store served on another host. Errors: this keyring does not hold the run's secret.
    pub fn for_store(&self) -> Result<Keyring> {
        let Secrets::Master(secret) = &self.secrets else {
            bail!("only the run's secret derives the store's keys");
        };
        Ok(Keyring {
            host: self.host,
            rank_hosts: self.rank_hosts.clone(),
            hosts: self.hosts,
            addresses: self.addresses.clone(),
            secrets: Secrets::Store {
                hosts: (0..self.host_count()).map(|h| store(secret, h)).collect(),
                launcher: store(secret, LAUNCHER_HOST),
            },
        })
    }

    /// `P(self.host, peer_host)`: the key of a connection between a process of this host and
    /// one of `peer_host`. `None`: no such host, or a store's keyring.
    pub fn pair_key(&self, peer_host: u32) -> Option<Key> {
        match &self.secrets {
            Secrets::Master(secret) => Some(pair(secret, self.host, peer_host)),
            Secrets::Host { pairs, .. } => pairs.get(peer_host as usize).cloned(),
            Secrets::Store { .. } => None,
        }
    }

    /// The pair key of this host and the host `rank` is placed on: the key of a connection
    /// with that rank. `None`: a rank outside the world, or a store's keyring.
    pub fn pair_key_with_rank(&self, rank: u64) -> Option<Key> {
        self.pair_key(self.host_of_rank(rank)?)
    }

    /// The key with which a process of this host proves itself to the store: `T(self.host)`.
    /// `None` for a store's keyring.
    pub fn store_key(&self) -> Option<Key> {
        match &self.secrets {
            Secrets::Master(secret) => Some(store(secret, self.host)),
            Secrets::Host { store, .. } => Some(store.clone()),
            Secrets::Store { .. } => None,
        }
    }

    /// For the store's side: the key `host` (or [`LAUNCHER_HOST`]) proves itself with.
    /// `None`: not a host of the run, or a keyring that does not hold it (one host's holds
    /// only its own).
    pub fn store_key_of(&self, host: u32) -> Option<Key> {
        match &self.secrets {
            Secrets::Master(secret) => {
                (host == LAUNCHER_HOST || host < self.host_count()).then(|| store(secret, host))
            }
            Secrets::Host { store, .. } => (host == self.host).then(|| store.clone()),
            Secrets::Store { hosts, launcher } => match host {
                LAUNCHER_HOST => Some(launcher.clone()),
                _ => hosts.get(host as usize).cloned(),
            },
        }
    }

    /// The keyring as one line of text (JSON with hex keys), for a rank's environment or an
    /// agent's frame. Errors: a master keyring (the run's secret never travels this way).
    pub fn to_text(&self) -> Result<String> {
        let mut wire = Wire {
            host: self.host,
            rank_hosts: self.rank_hosts.clone(),
            hosts: self.hosts,
            addresses: self.addresses.clone(),
            store: None,
            pairs: Vec::new(),
            store_hosts: Vec::new(),
            store_launcher: None,
        };
        match &self.secrets {
            Secrets::Master(_) => bail!("the run's secret is not written out"),
            Secrets::Host { store, pairs } => {
                wire.store = Some(store.hex());
                wire.pairs = pairs.iter().map(Key::hex).collect();
            }
            Secrets::Store { hosts, launcher } => {
                wire.store_hosts = hosts.iter().map(Key::hex).collect();
                wire.store_launcher = Some(launcher.hex());
            }
        }
        Ok(serde_json::to_string(&wire)?)
    }

    /// Reads [`Keyring::to_text`]'s line. Errors: malformed text, a key that is not 64 hex
    /// digits, neither a host's nor a store's keys.
    pub fn from_text(text: &str) -> Result<Keyring> {
        let wire: Wire = serde_json::from_str(text).context("malformed run keys")?;
        let keys = |list: &[String]| -> Result<Vec<Key>> {
            list.iter().map(|k| Key::from_hex(k)).collect()
        };
        let secrets = match (wire.store, wire.store_launcher) {
            (Some(store), None) => Secrets::Host {
                store: Key::from_hex(&store)?,
                pairs: keys(&wire.pairs)?,
            },
            (None, Some(launcher)) => Secrets::Store {
                hosts: keys(&wire.store_hosts)?,
                launcher: Key::from_hex(&launcher)?,
            },
            _ => bail!("run keys that are neither one host's nor a store's"),
        };
        if wire.rank_hosts.is_empty() {
            bail!("run keys without the host of each rank");
        }
        Ok(Keyring {
            host: wire.host,
            rank_hosts: wire.rank_hosts,
            hosts: wire.hosts,
            addresses: wire.addresses,
            secrets,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> Keyring {
        // Ranks 0, 1 on host 0; 2, 3 on host 1; 4 on host 2.
        Keyring::master(
            "0123456789abcdef0123456789abcdef",
            LAUNCHER_HOST,
            vec![0, 0, 1, 1, 2],
        )
    }

    #[test]
    fn two_hosts_derive_the_same_pair_key_and_no_other_host_holds_it() {
        let master = run();
        let (a, b, c) = (
            master.for_host(0).expect("a"),
            master.for_host(1).expect("b"),
            master.for_host(2).expect("c"),
        );
        assert_eq!(a.pair_key(1), b.pair_key(0));
        assert_eq!(a.pair_key(0), master.on_host(0).pair_key(0));
        // Host 2 holds P(2, ·) only: none of its keys is P(0, 1).
        let p01 = a.pair_key(1).expect("P(0,1)");
        for peer in 0..3 {
            assert_ne!(c.pair_key(peer), Some(p01.clone()));
        }
        assert_eq!(c.pair_key(3), None, "no fourth host");
        // Store keys: each host holds its own; the store's keyring holds all of them.
        let store = master.for_store().expect("store");
        for (host, keyring) in [(0, &a), (1, &b), (2, &c)] {
            assert_eq!(store.store_key_of(host), keyring.store_key());
            assert_eq!(keyring.store_key_of(host), keyring.store_key());
            assert_eq!(keyring.store_key_of((host + 1) % 3), None);
        }
        assert_eq!(store.store_key_of(LAUNCHER_HOST), master.store_key());
        assert_ne!(a.store_key(), b.store_key());
        assert!(a.for_host(1).is_err(), "one host's keys derive no other's");
    }

    #[test]
    fn keyrings_travel_as_text_without_the_secret() {
        let master = run();
        assert!(master.to_text().is_err(), "the secret is never written out");
        let host = master.for_host(1).expect("host");
        let text = host.to_text().expect("text");
        assert!(!text.contains("0123456789abcdef0123456789abcdef"));
        let back = Keyring::from_text(&text).expect("parse");
        assert_eq!(back.host(), 1);
        assert_eq!(back.host_of_rank(4), Some(2));
        assert_eq!(back.pair_key(2), host.pair_key(2));
        assert_eq!(back.store_key(), host.store_key());
        let store = master.for_store().expect("store");
        let back = Keyring::from_text(&store.to_text().expect("text")).expect("parse");
        assert_eq!(back.store_key_of(2), store.store_key_of(2));
        assert!(format!("{back:?}").contains("Store(…)"));
        assert!(Keyring::from_text("{\"host\":0,\"rank_hosts\":[0],\"hosts\":1}").is_err());
        // A host without ranks (an agent that only watches the store) has its keys too.
        let wider = master.clone().with_hosts(4);
        assert!(wider.for_host(3).expect("host 3").store_key().is_some());
        assert_eq!(
            wider.for_store().expect("store").store_key_of(3),
            wider.for_host(3).expect("host 3").store_key()
        );
        assert!(Keyring::from_text("not json").is_err());
    }
}
