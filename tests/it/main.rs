//! Integration tests: one binary, one module per area. Each test runs the real `infer`
//! binary (or the library at its public edge) on real inputs: the fixtures in
//! `../shared/fixtures/`, fake sysfs trees built in temp dirs, this machine. What several
//! modules need is in [`support`]; no test module imports another (`tests/tidy.rs` checks).

// A test binary has no API: its helpers are `pub` for the other test modules.
#![allow(unreachable_pub)]

mod clients;
mod cluster;
mod cuda;
mod device_ranks;
mod distributed;
mod doctor;
mod dummy;
mod engine;
mod health;
mod model;
mod pd;
mod plan;
mod plan_check;
mod prefix;
mod readme;
mod restarts;
mod scheduling;
mod serve;
mod serving_engines;
mod sharding;
mod support;
mod tokenizer_export;
mod topo;
