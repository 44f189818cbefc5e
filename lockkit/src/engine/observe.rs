//! What a finished lock call reports: its span's outcome and wait and, with
//! the `metrics` feature, the wait-time histogram and the counters of busy
//! keys, timeouts and deadlocks (see the crate docs, "Observability").
//!
//! A call's metric keys are made and hashed at compile time, one set per key
//! type ([`key_type!`]), so that reporting a call allocates and hashes
//! nothing.

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

    /// The counter this outcome also increments, if any: its index in
    /// [`KeyType`]'s counters.
    #[cfg(feature = "metrics")]
    fn counter(self) -> Option<usize> {
        match self {
            Outcome::Busy => Some(0),
            Outcome::Timeout => Some(1),
            Outcome::Deadlock => Some(2),
            _ => None,
        }
    }
}

/// The labels of a key type's metrics, made at compile time: the
/// [`KeyType`]'s metric keys borrow them, so they must live in a constant of
/// their own (see [`key_type!`]).
#[derive(Debug)]
pub(crate) struct Labels {
    /// `key_type` and `outcome`, one pair per [`Outcome`], in the order of
    /// [`Outcome::ALL`].
    #[cfg(feature = "metrics")]
    wait: [[Label; 2]; Outcome::ALL.len()],
    /// `key_type` alone, for the counters.
    #[cfg(feature = "metrics")]
    counter: [Label; 1],
}

impl Labels {
    /// The labels of the key type `name`.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) const fn new(name: &'static str) -> Self {
        Labels {
            #[cfg(feature = "metrics")]
            wait: {
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
            counter: [Label::from_static_parts("key_type", name)],
        }
    }
}

/// The key type a lock call reports: the span's `key_type` field and, with
/// the `metrics` feature, its metric keys, hashed at compile time (a key
/// made at run time hashes its name and labels on every call).
#[derive(Debug)]
pub(crate) struct KeyType {
    name: &'static str,
    /// The wait-time histogram's key per [`Outcome`], in the order of
    /// [`Outcome::ALL`].
    #[cfg(feature = "metrics")]
    wait: [Key; Outcome::ALL.len()],
    /// The counters' keys: busy keys, timeouts, deadlocks.
    #[cfg(feature = "metrics")]
    counters: [Key; 3],
}

/// The `&'static KeyType` named `$name` (a constant expression, which may
/// use the caller's generic parameters), with its labels in a constant of
/// their own.
macro_rules! key_type {
    ($name:expr) => {
        const {
            &$crate::engine::observe::KeyType::new(
                $name,
                const { &$crate::engine::observe::Labels::new($name) },
            )
        }
    };
}
pub(crate) use key_type;

impl KeyType {
    /// A batch.
    pub(crate) const BATCH: &'static KeyType = key_type!("batch");

    /// The key type `name` (an [`AdvisoryKey`](crate::AdvisoryKey)'s
    /// namespace), whose metrics carry `labels`; made with [`key_type!`].
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) const fn new(name: &'static str, labels: &'static Labels) -> Self {
        KeyType {
            name,
            #[cfg(feature = "metrics")]
            wait: {
                const fn wait(labels: &'static [Label; 2]) -> Key {
                    Key::from_static_parts("lockkit_lock_wait_seconds", labels)
                }
                let w = &labels.wait;
                [
                    wait(&w[0]),
                    wait(&w[1]),
                    wait(&w[2]),
                    wait(&w[3]),
                    wait(&w[4]),
                    wait(&w[5]),
                    wait(&w[6]),
                    wait(&w[7]),
                    wait(&w[8]),
                ]
            },
            #[cfg(feature = "metrics")]
            counters: [
                Key::from_static_parts("lockkit_lock_busy_total", &labels.counter),
                Key::from_static_parts("lockkit_lock_timeouts_total", &labels.counter),
                Key::from_static_parts("lockkit_lock_deadlocks_total", &labels.counter),
            ],
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
        let key = &key_type.wait[outcome as usize];
        metrics::with_recorder(|r| r.register_histogram(key, &METADATA))
            .record(waited.as_secs_f64());
        if let Some(i) = outcome.counter() {
            let key = &key_type.counters[i];
            metrics::with_recorder(|r| r.register_counter(key, &METADATA)).increment(1);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = key_type;
}

/// What the tests of lock calls see of their spans and events.
///
/// `tracing` caches, per callsite, whether any subscriber wants it, and
/// works that out when the callsite is first hit: while at most one
/// dispatcher is registered, from the default of the thread that hits it.
/// A test with a subscriber of its own (`with_default`) therefore races
/// every test running beside it with none: if one of those hits lockkit's
/// span first, the span is cached as wanted by nobody, for every thread,
/// and the recording test sees nothing. So the test binary has one global
/// subscriber, which wants everything and hands it to the recorder of the
/// thread it happens on, if that thread is recording.
#[cfg(test)]
pub(crate) mod recording {
    use std::cell::RefCell;
    use std::sync::{Arc, Mutex, Once};

    use tracing_subscriber::layer::{Context, SubscriberExt};

    /// The spans made (`span=<name>`), the events (`event=<level>`) and
    /// the fields recorded into either (`<field>=<value>`), in order.
    #[derive(Clone, Default)]
    struct Recorded(Arc<Mutex<Vec<String>>>);

    impl Recorded {
        fn push(&self, line: String) {
            self.0.lock().unwrap().push(line);
        }
    }

    impl tracing::field::Visit for Recorded {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.push(format!("{}={value:?}", field.name()));
        }
    }

    thread_local! {
        /// This thread's recorder, while it runs [`recorded`].
        static RECORDER: RefCell<Option<Recorded>> = const { RefCell::new(None) };
    }

    fn recorder() -> Option<Recorded> {
        RECORDER.with(|r| r.borrow().clone())
    }

    /// The global subscriber's layer: hands everything to this thread's
    /// recorder.
    struct Router;

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Router {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            _: &tracing::span::Id,
            _: Context<'_, S>,
        ) {
            if let Some(r) = recorder() {
                r.push(format!("span={}", attrs.metadata().name()));
            }
        }

        fn on_record(
            &self,
            _: &tracing::span::Id,
            values: &tracing::span::Record<'_>,
            _: Context<'_, S>,
        ) {
            if let Some(mut r) = recorder() {
                values.record(&mut r);
            }
        }

        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            if let Some(mut r) = recorder() {
                r.push(format!("event={}", event.metadata().level()));
                event.record(&mut r);
            }
        }
    }

    /// Runs `f` on this thread, recording what it reports, and answers
    /// what it saw, joined by `, `.
    pub(crate) fn recorded<R>(f: impl FnOnce() -> R) -> (R, String) {
        static GLOBAL: Once = Once::new();
        GLOBAL.call_once(|| {
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Router))
                .expect("the only global subscriber of lockkit's unit tests");
        });
        // A callsite hit before the global subscriber existed may still be
        // cached as wanted by nobody; from here on every thread's default
        // is the global one, which wants it.
        tracing::callsite::rebuild_interest_cache();
        let seen = Recorded::default();
        RECORDER.with(|r| *r.borrow_mut() = Some(seen.clone()));
        let out = f();
        RECORDER.with(|r| *r.borrow_mut() = None);
        let seen = seen.0.lock().unwrap().join(", ");
        (out, seen)
    }
}

#[cfg(test)]
mod outcome_tests {
    use super::recording::recorded;
    use super::*;

    /// A failed call's outcome names its error kind where the metrics count
    /// that kind, and is `error` for every other kind.
    #[test]
    fn a_failed_call_is_named_by_its_kind() {
        let named = [
            (ErrorKind::Timeout, "timeout"),
            (ErrorKind::Cancelled, "cancelled"),
            (ErrorKind::Deadlock, "deadlock"),
            (ErrorKind::LockTableFull, "lock_table_full"),
            (ErrorKind::ConnectionLost, "connection_lost"),
            (ErrorKind::UnexpectedReply, "unexpected_reply"),
            (ErrorKind::Database, "error"),
            (ErrorKind::Poisoned, "error"),
        ];
        for (kind, label) in named {
            assert_eq!(Outcome::of(kind).label(), label, "{kind:?}");
        }
        assert_eq!(Outcome::Granted.label(), "granted");
        assert_eq!(Outcome::Busy.label(), "busy");
    }

    /// A call's span is given its outcome and how long it waited.
    #[test]
    fn a_call_records_its_outcome_and_wait_in_its_span() {
        let ((), seen) = recorded(|| {
            let span = tracing::info_span!(
                "lock",
                outcome = tracing::field::Empty,
                wait_ms = tracing::field::Empty
            );
            observe(
                &span,
                key_type!("some.type"),
                Outcome::Timeout,
                Duration::from_millis(5),
            );
        });
        assert!(seen.contains("outcome=\"timeout\""), "{seen}");
        assert!(seen.contains("wait_ms=5.0"), "{seen}");
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use super::*;

    /// Each outcome's key names the histogram and the outcome: the table is
    /// in [`Outcome::ALL`]'s order, which is the enum's. Each key, made at
    /// compile time, is the key `metrics` makes at run time (same hash).
    #[test]
    fn every_outcome_has_its_key() {
        let key_type = key_type!("some.type");
        let labels = |name: &str, outcome: Option<Outcome>| {
            let mut labels = vec![Label::new("key_type", name.to_owned())];
            labels.extend(outcome.map(|o| Label::new("outcome", o.label())));
            labels
        };
        for (i, outcome) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome as usize, i);
            let key = &key_type.wait[outcome as usize];
            let made = Key::from_parts(
                "lockkit_lock_wait_seconds",
                labels("some.type", Some(outcome)),
            );
            assert_eq!(key, &made);
            assert_eq!(key.get_hash(), made.get_hash());
            match outcome.counter() {
                Some(c) => {
                    let counter = &key_type.counters[c];
                    let expected = match outcome {
                        Outcome::Busy => "lockkit_lock_busy_total",
                        Outcome::Timeout => "lockkit_lock_timeouts_total",
                        Outcome::Deadlock => "lockkit_lock_deadlocks_total",
                        other => panic!("{other:?} counts nothing"),
                    };
                    assert_eq!(counter.name(), expected);
                    let made =
                        Key::from_parts(counter.name().to_owned(), labels("some.type", None));
                    assert_eq!((counter, counter.get_hash()), (&made, made.get_hash()));
                }
                None => assert!(matches!(
                    outcome,
                    Outcome::Granted
                        | Outcome::Cancelled
                        | Outcome::LockTableFull
                        | Outcome::ConnectionLost
                        | Outcome::UnexpectedReply
                        | Outcome::Error
                )),
            }
        }
        let names: Vec<_> = key_type.counters.iter().map(Key::name).collect();
        assert_eq!(
            names,
            [
                "lockkit_lock_busy_total",
                "lockkit_lock_timeouts_total",
                "lockkit_lock_deadlocks_total"
            ]
        );
    }
}

/// What the span of every call records, with or without `metrics`.
#[cfg(test)]
mod names {
    use super::*;

    /// Each outcome has its own label, the one the docs and dashboards
    /// use; a key type is named by its namespace.
    #[test]
    fn outcomes_and_key_types_are_named() {
        let labels = [
            (Outcome::Granted, "granted"),
            (Outcome::Busy, "busy"),
            (Outcome::Timeout, "timeout"),
            (Outcome::Cancelled, "cancelled"),
            (Outcome::Deadlock, "deadlock"),
            (Outcome::LockTableFull, "lock_table_full"),
            (Outcome::ConnectionLost, "connection_lost"),
            (Outcome::UnexpectedReply, "unexpected_reply"),
            (Outcome::Error, "error"),
        ];
        for (outcome, label) in labels {
            assert_eq!(outcome.label(), label);
        }
        assert_eq!(key_type!("billing.invoice").name(), "billing.invoice");
        assert_eq!(KeyType::BATCH.name(), "batch");
    }
}
