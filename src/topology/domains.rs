//! NVLink domains: a partition of a host's GPUs into groups in which every pair is NVLinked.
//!
//! Tensor parallelism wants its group inside one domain: a TP all-reduce runs at the speed
//! of its slowest pair. A DGX-1 (V100, hybrid cube-mesh) has two fully connected quads,
//! {0-3} and {4-7}; an HGX/NVSwitch board is one domain of 8.

use super::LinkCode;

/// Partitions GPUs `0..n_gpus` into NVLink domains from the `n_gpus × n_gpus` link matrix.
///
/// Greedy maximum-clique cover: repeatedly take the largest set of remaining GPUs in
/// which every pair is `NV<n>` (ties go to the lexicographically smallest index list), so
/// the first domains are as large as the hardware allows. GPUs with no NVLink end up as
/// domains of one. Domains are sorted internally and ordered by their first GPU.
pub fn nvlink_domains(gpu_links: &[Vec<LinkCode>]) -> Vec<Vec<usize>> {
    let n_gpus = gpu_links.len();
    let linked = |a: usize, b: usize| gpu_links[a].get(b).is_some_and(|code| code.is_nvlink());
    let mut remaining: Vec<usize> = (0..n_gpus).collect();
    let mut domains = Vec::new();
    while !remaining.is_empty() {
        let mut best: Vec<usize> = Vec::new();
        bron_kerbosch(
            &linked,
            Vec::new(),
            remaining.clone(),
            Vec::new(),
            &mut best,
        );
        if best.is_empty() {
            best.push(remaining[0]);
        }
        best.sort_unstable();
        remaining.retain(|gpu| !best.contains(gpu));
        domains.push(best);
    }
    domains.sort();
    domains
}

/// Bron–Kerbosch with pivoting (Tomita et al., 2006), keeping the largest clique found and,
/// among cliques of that size, the lexicographically smallest.
fn bron_kerbosch(
    linked: &dyn Fn(usize, usize) -> bool,
    clique: Vec<usize>,
    mut candidates: Vec<usize>,
    mut excluded: Vec<usize>,
    best: &mut Vec<usize>,
) {
    if candidates.is_empty() && excluded.is_empty() {
        let mut sorted = clique;
        sorted.sort_unstable();
        if sorted.len() > best.len() || (sorted.len() == best.len() && sorted < *best) {
            *best = sorted;
        }
        return;
    }
    // A clique of this branch cannot beat `best` when even all candidates would not reach it.
    if clique.len() + candidates.len() < best.len() {
        return;
    }
    let pivot = candidates
        .iter()
        .chain(excluded.iter())
        .copied()
        .max_by_key(|&u| candidates.iter().filter(|&&v| linked(u, v)).count())
        .expect("candidates or excluded is non-empty here");
    let branch: Vec<usize> = candidates
        .iter()
        .copied()
        .filter(|&v| !linked(pivot, v))
        .collect();
    for v in branch {
        let mut next_clique = clique.clone();
        next_clique.push(v);
        let next_candidates = candidates
            .iter()
            .copied()
            .filter(|&u| linked(v, u))
            .collect();
        let next_excluded = excluded.iter().copied().filter(|&u| linked(v, u)).collect();
        bron_kerbosch(linked, next_clique, next_candidates, next_excluded, best);
        candidates.retain(|&u| u != v);
        excluded.push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(rows: &[&str]) -> Vec<Vec<LinkCode>> {
        rows.iter()
            .map(|row| {
                row.split_whitespace()
                    .map(|cell| cell.parse().expect("valid code"))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn nvswitch_board_is_one_domain() {
        let n = 8;
        let links: Vec<Vec<LinkCode>> = (0..n)
            .map(|i| {
                (0..n)
                    .map(|j| {
                        if i == j {
                            LinkCode::SelfLink
                        } else {
                            LinkCode::NvLink(18)
                        }
                    })
                    .collect()
            })
            .collect();
        assert_eq!(nvlink_domains(&links), vec![(0..8).collect::<Vec<_>>()]);
    }

    #[test]
    fn dgx1_hybrid_cube_mesh_is_two_quads() {
        // Rows of the DGX-1 V100 matrix (pytorch DDP benchmark README).
        let links = matrix(&[
            "X NV1 NV1 NV2 NV2 SYS SYS SYS",
            "NV1 X NV2 NV1 SYS NV2 SYS SYS",
            "NV1 NV2 X NV2 SYS SYS NV1 SYS",
            "NV2 NV1 NV2 X SYS SYS SYS NV1",
            "NV2 SYS SYS SYS X NV1 NV1 NV2",
            "SYS NV2 SYS SYS NV1 X NV2 NV1",
            "SYS SYS NV1 SYS NV1 NV2 X NV2",
            "SYS SYS SYS NV1 NV2 NV1 NV2 X",
        ]);
        assert_eq!(
            nvlink_domains(&links),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
    }

    #[test]
    fn pcie_only_gpus_are_singletons() {
        let links = matrix(&["X PHB", "PHB X"]);
        assert_eq!(nvlink_domains(&links), vec![vec![0], vec![1]]);
    }

    #[test]
    fn nvlink_bridged_pairs_are_pairs() {
        // Two NVLink bridges on a 4×A6000 workstation: {0,1} and {2,3}.
        let links = matrix(&[
            "X NV4 SYS SYS",
            "NV4 X SYS SYS",
            "SYS SYS X NV4",
            "SYS SYS NV4 X",
        ]);
        assert_eq!(nvlink_domains(&links), vec![vec![0, 1], vec![2, 3]]);
    }

    #[test]
    fn no_gpus_no_domains() {
        assert!(nvlink_domains(&[]).is_empty());
    }
}
