//! Worker runtime (see ARCHITECTURE.md).
