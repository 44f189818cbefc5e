//! Where a driver's own reports land: a `tracing` layer that records every
//! event of one target with the names of the spans it was emitted in, so a
//! test can check that what a driver reports of lockkit's statements is
//! inside the lock call's `lockkit.lock` span (and that the application's
//! own statements are not).

use std::fmt::{self, Write as _};
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};

use tracing::field::{Field, Visit};
use tracing::subscriber::NoSubscriber;
use tracing::{Dispatch, Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// One recorded event.
#[derive(Clone, Debug)]
pub struct Seen {
    /// Its fields, as `name=value` text (the message included).
    pub fields: String,
    /// The names of the spans it was in, innermost first.
    pub spans: Vec<&'static str>,
}

/// Records the events of one target (see the module docs).
#[derive(Clone, Debug)]
pub struct Events {
    target: &'static str,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Events {
    /// Records the events whose target is `target`.
    pub fn new(target: &'static str) -> Self {
        Events {
            target,
            seen: Arc::default(),
        }
    }

    /// The events recorded so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Runs `body` on this thread with a subscriber of this layer alone as
    /// the thread's default (it takes every level, so lockkit makes its
    /// spans).
    ///
    /// `tracing` caches whether each callsite is enabled. While a single
    /// dispatcher is registered, it computes that from the default of the
    /// thread that first hits the callsite: a callsite that a test running
    /// in parallel (no subscriber) hit first would be disabled for this
    /// thread's subscriber too, and lockkit's span would be none. An idle
    /// dispatcher, registered once and kept for the process, makes it ask
    /// every registered dispatcher instead.
    pub fn blocking<T>(&self, body: impl FnOnce() -> T) -> T {
        static IDLE: OnceLock<Dispatch> = OnceLock::new();
        IDLE.get_or_init(|| Dispatch::new(NoSubscriber::default()));
        let subscriber = tracing_subscriber::registry().with(self.clone());
        tracing::subscriber::with_default(subscriber, body)
    }

    /// Runs `body` to completion on a current-thread runtime of its own,
    /// inside [`Events::blocking`]: every poll of it happens on this thread.
    pub fn run<F: Future>(&self, body: F) -> F::Output {
        self.blocking(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime")
                .block_on(body)
        })
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Events {
    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        if event.metadata().target() != self.target {
            return;
        }
        let mut fields = String::new();
        event.record(&mut Text(&mut fields));
        let spans = ctx
            .event_scope(event)
            .map(|scope| scope.map(|span| span.name()).collect())
            .unwrap_or_default();
        self.seen.lock().unwrap().push(Seen { fields, spans });
    }
}

/// Writes each field as `name=value `.
struct Text<'a>(&'a mut String);

impl Visit for Text<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let _ = write!(self.0, "{}={value:?} ", field.name());
    }
}

/// The span test's check (the conformance suite's
/// `a_lock_calls_statements_are_reported_inside_its_span`, on each stack
/// whose driver reports its statements), over what a driver reported
/// (`seen`) of a transaction that took, in this order, a lock, a try, a
/// two-key batch and a timed lock (`BigInt` keys), then ran a statement of
/// its own whose text contains `the application`:
///
/// - each lock call's statements were reported, the timed lock's savepoint
///   included;
/// - every statement of lockkit's (its text starts `/* lockkit:`, or names
///   lockkit's savepoint) was reported inside a `lockkit.lock` span, and in
///   no other span;
/// - the application's statement was reported once, in no span (the
///   control: the check can tell).
///
/// # Panics
///
/// When any of these does not hold, with what was seen.
pub fn assert_lock_statements_in_span(seen: &[Seen]) {
    let lockkit: Vec<&Seen> = seen
        .iter()
        .filter(|e| e.fields.contains("/* lockkit:") || e.fields.contains("lockkit_acquire"))
        .collect();
    for statement in [
        "lockkit:lock_bigint ",
        "lockkit:try_bigint ",
        "lockkit:batch_bigint_exclusive ",
        "lockkit:set_timeouts ",
        "SAVEPOINT lockkit_acquire",
    ] {
        assert!(
            lockkit.iter().any(|e| e.fields.contains(statement)),
            "the driver reported no {statement:?}: {seen:#?}"
        );
    }
    for event in &lockkit {
        assert_eq!(event.spans, ["lockkit.lock"], "{event:#?}");
    }
    let mine: Vec<&Seen> = seen
        .iter()
        .filter(|e| e.fields.contains("the application"))
        .collect();
    assert_eq!(mine.len(), 1, "{seen:#?}");
    assert!(mine[0].spans.is_empty(), "{:#?}", mine[0]);
}
