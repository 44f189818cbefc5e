//! Runnable lockkit examples.
