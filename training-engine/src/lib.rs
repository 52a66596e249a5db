//! Training engine (see ARCHITECTURE.md).
