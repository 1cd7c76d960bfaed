//! The parallel degrees of a layout (tp, pp, dp, ep): one type from the command line through
//! the planner and the launcher to each rank, so a degree is never re-declared or re-typed
//! (the planner converts one to `u64` only where it meets byte counts). Any layer may use it
//! (it imports nothing of the crate).

use serde::{Deserialize, Serialize};

/// How a model is spread over ranks. `world_size = tp · pp · dp`; ranks are ordered DP, PP,
/// TP (TP fastest), as vLLM orders them; `ep` divides `tp · dp` and re-shards the experts of
/// one PP stage (vLLM: EP = TP × DP with expert parallelism on).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Degrees {
    /// Tensor parallelism: ranks that split every layer.
    pub tp: usize,
    /// Pipeline parallelism: stages of contiguous layers.
    pub pp: usize,
    /// Expert parallelism: ranks the MoE experts are sharded over (1: none).
    pub ep: usize,
    /// Data parallelism: independent replicas of `tp · pp` ranks.
    pub dp: usize,
}

impl Default for Degrees {
    fn default() -> Degrees {
        Degrees::ONE
    }
}

impl Degrees {
    /// One rank: no parallelism.
    pub const ONE: Degrees = Degrees {
        tp: 1,
        pp: 1,
        ep: 1,
        dp: 1,
    };

    /// Ranks (GPUs, or CPU rank processes) the layout uses: `tp · pp · dp`.
    pub fn world_size(&self) -> usize {
        self.tp * self.pp * self.dp
    }

    /// Ranks of one replica: `tp · pp`.
    pub fn replica_size(&self) -> usize {
        self.tp * self.pp
    }

    /// Every degree pinned to this one's.
    pub fn pins(&self) -> DegreePins {
        DegreePins {
            tp: Some(self.tp),
            pp: Some(self.pp),
            dp: Some(self.dp),
            ep: Some(self.ep),
        }
    }

    /// Errors: a degree of 0 (the message names every degree).
    pub fn check(&self) -> anyhow::Result<()> {
        if self.tp == 0 || self.pp == 0 || self.dp == 0 || self.ep == 0 {
            anyhow::bail!(
                "every degree must be at least 1 (tp {}, pp {}, dp {}, ep {})",
                self.tp,
                self.pp,
                self.dp,
                self.ep
            );
        }
        Ok(())
    }
}

impl std::fmt::Display for Degrees {
    /// `TP2 × PP1 × DP1`, with ` (EP2)` when experts are sharded.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TP{} × PP{} × DP{}", self.tp, self.pp, self.dp)?;
        if self.ep > 1 {
            write!(f, " (EP{})", self.ep)?;
        }
        Ok(())
    }
}

/// The degrees a user pinned (`--tp`, `--pp`, `--dp`, `--ep`); `None`: the planner or the
/// launcher chooses (by default 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DegreePins {
    pub tp: Option<usize>,
    pub pp: Option<usize>,
    pub dp: Option<usize>,
    pub ep: Option<usize>,
}

impl DegreePins {
    /// Whether any degree is pinned.
    pub fn any(&self) -> bool {
        self.tp.or(self.pp).or(self.dp).or(self.ep).is_some()
    }

    /// The pinned degrees, 1 where none is pinned.
    pub fn or_one(&self) -> Degrees {
        Degrees {
            tp: self.tp.unwrap_or(1),
            pp: self.pp.unwrap_or(1),
            ep: self.ep.unwrap_or(1),
            dp: self.dp.unwrap_or(1),
        }
    }

    /// Each pinned degree with its flag's name (`--tp`, `--pp`, `--dp`, `--ep`), for errors
    /// that name what was given.
    pub fn named(&self) -> [(&'static str, Option<usize>); 4] {
        [
            ("--tp", self.tp),
            ("--pp", self.pp),
            ("--dp", self.dp),
            ("--ep", self.ep),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::{DegreePins, Degrees};

    #[test]
    fn world_size_counts_tp_pp_dp_and_not_ep() {
        let d = Degrees {
            tp: 4,
            pp: 2,
            ep: 8,
            dp: 2,
        };
        assert_eq!(d.world_size(), 16);
        assert_eq!(d.replica_size(), 8);
        assert_eq!(d.to_string(), "TP4 × PP2 × DP2 (EP8)");
        assert_eq!(Degrees::ONE.to_string(), "TP1 × PP1 × DP1");
        assert!(d.check().is_ok());
        let error = Degrees { pp: 0, ..d }.check().unwrap_err().to_string();
        assert!(error.contains("pp 0"), "{error}");
    }

    #[test]
    fn pins_default_to_one_and_say_whether_any_is_set() {
        assert!(!DegreePins::default().any());
        assert_eq!(DegreePins::default().or_one(), Degrees::ONE);
        let pins = DegreePins {
            pp: Some(3),
            ..DegreePins::default()
        };
        assert!(pins.any());
        assert_eq!(
            pins.or_one(),
            Degrees {
                pp: 3,
                ..Degrees::ONE
            }
        );
        assert_eq!(pins.named()[1], ("--pp", Some(3)));
    }
}
