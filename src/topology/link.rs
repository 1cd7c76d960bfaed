//! The link codes of `nvidia-smi topo -m` (`X`, `NV<n>`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`)
//! and of `nvidia-smi topo -p2p` (`OK`, `CNS`, `GNS`, …), with parsing and ordering.
//!
//! Codes are serialized as the exact strings nvidia-smi prints, so JSON reads like the matrix.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How two devices reach each other, in `nvidia-smi topo -m` terms. Ordered from closest
/// (`X`, then more NVLinks first) to farthest (`SYS`).
///
/// Meanings (nvidia-smi's legend): `PIX` at most one PCIe bridge; `PXB` several PCIe
/// bridges without the host bridge; `PHB` through a PCIe host bridge (the CPU); `NODE`
/// between host bridges of one NUMA node; `SYS` across the SMP interconnect (QPI/UPI).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkCode {
    /// The device itself (`X`).
    SelfLink,
    /// A bonded set of this many NVLinks (`NV<n>`), `n ≥ 1`.
    NvLink(u32),
    /// `PIX`: at most a single PCIe bridge.
    Pix,
    /// `PXB`: multiple PCIe bridges, not the host bridge.
    Pxb,
    /// `PHB`: a PCIe host bridge (typically the CPU).
    Phb,
    /// `NODE`: the interconnect between host bridges within one NUMA node.
    Node,
    /// `SYS`: the SMP interconnect between NUMA nodes (QPI/UPI/xGMI).
    Sys,
}

impl LinkCode {
    /// True for `NV<n>`.
    pub fn is_nvlink(self) -> bool {
        matches!(self, LinkCode::NvLink(_))
    }

    /// True when GPUDirect RDMA is typically usable between a NIC and a GPU at this
    /// distance: `PIX` or `PXB` (NCCL's default `NCCL_NET_GDR_LEVEL` is `PXB`).
    pub fn allows_gdr(self) -> bool {
        matches!(self, LinkCode::Pix | LinkCode::Pxb)
    }

    /// Rank for ordering: lower is closer. NVLink sorts before PCIe.
    fn class(self) -> u8 {
        match self {
            LinkCode::SelfLink => 0,
            LinkCode::NvLink(_) => 1,
            LinkCode::Pix => 2,
            LinkCode::Pxb => 3,
            LinkCode::Phb => 4,
            LinkCode::Node => 5,
            LinkCode::Sys => 6,
        }
    }
}

impl Ord for LinkCode {
    fn cmp(&self, other: &Self) -> Ordering {
        match (self, other) {
            // More bonded links is a closer (faster) connection.
            (LinkCode::NvLink(a), LinkCode::NvLink(b)) => b.cmp(a),
            _ => self.class().cmp(&other.class()),
        }
    }
}

impl PartialOrd for LinkCode {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for LinkCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkCode::SelfLink => f.write_str("X"),
            LinkCode::NvLink(n) => write!(f, "NV{n}"),
            LinkCode::Pix => f.write_str("PIX"),
            LinkCode::Pxb => f.write_str("PXB"),
            LinkCode::Phb => f.write_str("PHB"),
            LinkCode::Node => f.write_str("NODE"),
            LinkCode::Sys => f.write_str("SYS"),
        }
    }
}

/// Error of [`LinkCode::from_str`] and [`P2pStatus::from_str`]: the text that was not a code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownCode(pub String);

impl fmt::Display for UnknownCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown code `{}`", self.0)
    }
}

impl std::error::Error for UnknownCode {}

impl FromStr for LinkCode {
    type Err = UnknownCode;

    /// Accepts nvidia-smi's codes, and `SOC` (the name of `SYS` before driver 384).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "X" => Ok(LinkCode::SelfLink),
            "PIX" => Ok(LinkCode::Pix),
            "PXB" => Ok(LinkCode::Pxb),
            "PHB" => Ok(LinkCode::Phb),
            "NODE" => Ok(LinkCode::Node),
            "SYS" | "SOC" => Ok(LinkCode::Sys),
            _ => match text.strip_prefix("NV").map(str::parse::<u32>) {
                Some(Ok(n)) if n >= 1 => Ok(LinkCode::NvLink(n)),
                _ => Err(UnknownCode(text.to_string())),
            },
        }
    }
}

/// Peer-to-peer status between two GPUs, as `nvidia-smi topo -p2p` prints it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum P2pStatus {
    /// The device itself (`X`).
    SelfLink,
    /// `OK`: peer access supported.
    Ok,
    /// `CNS`: chipset not supported.
    ChipsetNotSupported,
    /// `GNS`: GPU not supported (typical for consumer GPUs such as the RTX 4090/5090).
    GpuNotSupported,
    /// `TNS`: topology not supported.
    TopologyNotSupported,
    /// `NS`: not supported.
    NotSupported,
    /// `DR`: disabled by regkey.
    DisabledByRegkey,
    /// `U`: unknown.
    Unknown,
}

impl P2pStatus {
    /// True for `OK`.
    pub fn is_ok(self) -> bool {
        self == P2pStatus::Ok
    }
}

impl fmt::Display for P2pStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            P2pStatus::SelfLink => "X",
            P2pStatus::Ok => "OK",
            P2pStatus::ChipsetNotSupported => "CNS",
            P2pStatus::GpuNotSupported => "GNS",
            P2pStatus::TopologyNotSupported => "TNS",
            P2pStatus::NotSupported => "NS",
            P2pStatus::DisabledByRegkey => "DR",
            P2pStatus::Unknown => "U",
        })
    }
}

impl FromStr for P2pStatus {
    type Err = UnknownCode;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Ok(match text {
            "X" => P2pStatus::SelfLink,
            "OK" => P2pStatus::Ok,
            "CNS" => P2pStatus::ChipsetNotSupported,
            "GNS" => P2pStatus::GpuNotSupported,
            "TNS" => P2pStatus::TopologyNotSupported,
            "NS" => P2pStatus::NotSupported,
            "DR" => P2pStatus::DisabledByRegkey,
            "U" => P2pStatus::Unknown,
            _ => return Err(UnknownCode(text.to_string())),
        })
    }
}

/// Serializes a code as the string nvidia-smi prints and parses it back.
macro_rules! serde_as_string {
    ($t:ty) => {
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = String::deserialize(deserializer)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

serde_as_string!(LinkCode);
serde_as_string!(P2pStatus);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_codes_round_trip_through_text() {
        for text in ["X", "NV1", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"] {
            let code: LinkCode = text.parse().expect("valid code");
            assert_eq!(code.to_string(), text);
        }
        assert_eq!("SOC".parse::<LinkCode>(), Ok(LinkCode::Sys));
    }

    #[test]
    fn bad_link_codes_are_rejected() {
        for text in ["NV0", "NV", "NVx", "nv2", "PCI", "", "OK"] {
            assert_eq!(
                text.parse::<LinkCode>(),
                Err(UnknownCode(text.to_string())),
                "{text}"
            );
        }
    }

    #[test]
    fn more_nvlinks_are_closer_and_nvlink_beats_pcie() {
        let mut codes = [
            LinkCode::Sys,
            LinkCode::NvLink(1),
            LinkCode::Pix,
            LinkCode::NvLink(18),
            LinkCode::Node,
            LinkCode::Phb,
            LinkCode::Pxb,
        ];
        codes.sort();
        let text: Vec<String> = codes.iter().map(ToString::to_string).collect();
        assert_eq!(text, ["NV18", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS"]);
    }

    #[test]
    fn p2p_codes_round_trip_through_text() {
        for text in ["X", "OK", "CNS", "GNS", "TNS", "NS", "DR", "U"] {
            let status: P2pStatus = text.parse().expect("valid status");
            assert_eq!(status.to_string(), text);
        }
        assert!("PIX".parse::<P2pStatus>().is_err());
    }
}
