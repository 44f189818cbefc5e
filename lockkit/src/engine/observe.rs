//! What a finished lock call reports: its span's outcome and wait and, with
//! the `metrics` feature, the wait-time histogram and the counters of busy
//! keys, timeouts and deadlocks (see the crate docs, "Observability").
//!
//! A call's labels are made at compile time, one set per key type
//! ([`KeyType::of`]), so that reporting a call allocates nothing.

use std::time::Duration;

use crate::engine::error::ErrorKind;

#[cfg(feature = "metrics")]
use metrics::{Key, Label, Level, Metadata};

/// How a lock call ended, as its span and metrics name it (`outcome`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Granted,
    Busy,
    Timeout,
    Cancelled,
    Deadlock,
    LockTableFull,
    ConnectionLost,
    UnexpectedReply,
    Error,
}

impl Outcome {
    /// Every outcome, in declaration order (an outcome's index here is
    /// `outcome as usize`).
    #[cfg(feature = "metrics")]
    const ALL: [Outcome; 9] = [
        Outcome::Granted,
        Outcome::Busy,
        Outcome::Timeout,
        Outcome::Cancelled,
        Outcome::Deadlock,
        Outcome::LockTableFull,
        Outcome::ConnectionLost,
        Outcome::UnexpectedReply,
        Outcome::Error,
    ];

    /// How a call that failed with `kind` ended.
    pub(crate) fn of(kind: ErrorKind) -> Outcome {
        match kind {
            ErrorKind::Timeout => Outcome::Timeout,
            ErrorKind::Cancelled => Outcome::Cancelled,
            ErrorKind::Deadlock => Outcome::Deadlock,
            ErrorKind::LockTableFull => Outcome::LockTableFull,
            ErrorKind::ConnectionLost => Outcome::ConnectionLost,
            ErrorKind::UnexpectedReply => Outcome::UnexpectedReply,
            _ => Outcome::Error,
        }
    }

    /// The label value.
    pub(crate) const fn label(self) -> &'static str {
        match self {
            Outcome::Granted => "granted",
            Outcome::Busy => "busy",
            Outcome::Timeout => "timeout",
            Outcome::Cancelled => "cancelled",
            Outcome::Deadlock => "deadlock",
            Outcome::LockTableFull => "lock_table_full",
            Outcome::ConnectionLost => "connection_lost",
            Outcome::UnexpectedReply => "unexpected_reply",
            Outcome::Error => "error",
        }
    }

    /// The counter this outcome also increments, if any.
    #[cfg(feature = "metrics")]
    fn counter(self) -> Option<&'static str> {
        match self {
            Outcome::Busy => Some("lockkit_lock_busy_total"),
            Outcome::Timeout => Some("lockkit_lock_timeouts_total"),
            Outcome::Deadlock => Some("lockkit_lock_deadlocks_total"),
            _ => None,
        }
    }
}

/// The key type a lock call reports: the span's `key_type` field and, with
/// the `metrics` feature, its metrics' labels, made once.
#[derive(Debug)]
pub(crate) struct KeyType {
    name: &'static str,
    /// `key_type` and `outcome`, one pair per [`Outcome`], in the order of
    /// [`Outcome::ALL`].
    #[cfg(feature = "metrics")]
    wait_labels: [[Label; 2]; Outcome::ALL.len()],
    /// `key_type` alone, for the counters.
    #[cfg(feature = "metrics")]
    counter_labels: [Label; 1],
}

impl KeyType {
    /// A plain key given as its `LockKey`.
    pub(crate) const RAW: &'static KeyType = &KeyType::new("raw");
    /// A batch.
    pub(crate) const BATCH: &'static KeyType = &KeyType::new("batch");

    /// The key type `name` (an [`AdvisoryKey`](crate::AdvisoryKey)'s
    /// namespace). Made in a constant (`const { &KeyType::new(..) }`), it
    /// lives as long as the program.
    pub(crate) const fn new(name: &'static str) -> Self {
        KeyType {
            name,
            #[cfg(feature = "metrics")]
            wait_labels: {
                const fn pair(name: &'static str, outcome: Outcome) -> [Label; 2] {
                    [
                        Label::from_static_parts("key_type", name),
                        Label::from_static_parts("outcome", outcome.label()),
                    ]
                }
                let all = Outcome::ALL;
                [
                    pair(name, all[0]),
                    pair(name, all[1]),
                    pair(name, all[2]),
                    pair(name, all[3]),
                    pair(name, all[4]),
                    pair(name, all[5]),
                    pair(name, all[6]),
                    pair(name, all[7]),
                    pair(name, all[8]),
                ]
            },
            #[cfg(feature = "metrics")]
            counter_labels: [Label::from_static_parts("key_type", name)],
        }
    }

    /// The name (the span's `key_type`).
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }
}

/// Reports a call that went to the server: records `outcome` and `waited`
/// in `span` and, with the `metrics` feature, in the histogram and the
/// counters, labelled with `key_type`.
pub(crate) fn observe(
    span: &tracing::Span,
    key_type: &'static KeyType,
    outcome: Outcome,
    waited: Duration,
) {
    if !span.is_disabled() {
        span.record("outcome", outcome.label());
        span.record("wait_ms", waited.as_secs_f64() * 1000.0);
    }
    #[cfg(feature = "metrics")]
    {
        static METADATA: Metadata<'static> =
            Metadata::new(module_path!(), Level::INFO, Some(module_path!()));
        let labels = &key_type.wait_labels[outcome as usize];
        let key = Key::from_static_labels("lockkit_lock_wait_seconds", labels);
        metrics::with_recorder(|r| r.register_histogram(&key, &METADATA))
            .record(waited.as_secs_f64());
        if let Some(name) = outcome.counter() {
            let key = Key::from_static_labels(name, &key_type.counter_labels);
            metrics::with_recorder(|r| r.register_counter(&key, &METADATA)).increment(1);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = key_type;
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use super::*;

    /// Each outcome's labels name it: the table is in [`Outcome::ALL`]'s
    /// order, which is the enum's.
    #[test]
    fn every_outcome_has_its_labels() {
        let key_type = const { &KeyType::new("some.type") };
        for (i, outcome) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome as usize, i);
            let labels = &key_type.wait_labels[outcome as usize];
            assert_eq!(
                (labels[0].key(), labels[0].value()),
                ("key_type", "some.type")
            );
            assert_eq!(
                (labels[1].key(), labels[1].value()),
                ("outcome", outcome.label())
            );
        }
        assert_eq!(key_type.counter_labels[0].value(), "some.type");
    }
}
