//! lockkit's test support.
