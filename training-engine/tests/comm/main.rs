//! Collective tests: one binary (threads for the fast matrix, re-executed test binary for
//! real multi-process runs).

mod failures;
mod features;
mod matrix;
mod multiprocess;
mod shared;
mod support;
