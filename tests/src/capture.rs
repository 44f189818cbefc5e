//! What the tests see of lockkit's `tracing` output, robustly: one global
//! subscriber for the whole test binary routes each span and event to the
//! sink of the thread that emitted it. (Thread-local subscribers installed
//! by tests running in parallel raced on tracing's callsite interest cache:
//! a test's subscriber sometimes saw nothing.)

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// A span's or an event's fields, as `(name, value)` text.
type Fields = Vec<(String, String)>;

/// Everything one test captured, in order: spans (by id) and WARN events.
#[derive(Clone, Debug, Default)]
pub struct Captured {
    spans: Arc<Mutex<Vec<(u64, String, String)>>>,
    warnings: Arc<Mutex<Vec<String>>>,
}

impl Captured {
    /// The values of span field `name`, in the order the spans were made.
    pub fn span_field(&self, name: &str) -> Vec<String> {
        let spans = self.spans.lock().unwrap();
        spans
            .iter()
            .filter(|(_, n, _)| n == name)
            .map(|(_, _, v)| v.clone())
            .collect()
    }

    /// The WARN events so far, each as `name=value …` text.
    pub fn warnings(&self) -> Vec<String> {
        self.warnings.lock().unwrap().clone()
    }

    /// Forgets the warnings so far.
    pub fn clear_warnings(&self) {
        self.warnings.lock().unwrap().clear();
    }
}

struct Collect<'a>(&'a mut Fields);

impl Visit for Collect<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.push((field.name().to_owned(), value.to_string()));
    }
}

type Sinks = Mutex<HashMap<ThreadId, Captured>>;

fn sinks() -> &'static Sinks {
    static SINKS: OnceLock<Sinks> = OnceLock::new();
    SINKS.get_or_init(|| {
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Router))
            .expect("the only global subscriber of this test binary");
        Sinks::default()
    })
}

fn current() -> Option<Captured> {
    let id = std::thread::current().id();
    sinks().lock().unwrap().get(&id).cloned()
}

struct Router;

impl<S: tracing::Subscriber> Layer<S> for Router {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        if attrs.metadata().name() != "lockkit.lock" {
            return;
        }
        if let Some(sink) = current() {
            let mut fields = Fields::new();
            attrs.record(&mut Collect(&mut fields));
            let mut spans = sink.spans.lock().unwrap();
            spans.extend(fields.into_iter().map(|(n, v)| (id.into_u64(), n, v)));
        }
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some(sink) = current() {
            let mut fields = Fields::new();
            values.record(&mut Collect(&mut fields));
            let mut spans = sink.spans.lock().unwrap();
            spans.extend(fields.into_iter().map(|(n, v)| (id.into_u64(), n, v)));
        }
    }
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() != tracing::Level::WARN {
            return;
        }
        let sink = current();
        // Cloned out, so that a hook runs with no lock held.
        let hooks: Vec<Hook> = hooks().lock().unwrap().values().cloned().collect();
        if sink.is_none() && hooks.is_empty() {
            return;
        }
        let mut fields = Fields::new();
        event.record(&mut Collect(&mut fields));
        let text = fields
            .into_iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        for hook in hooks {
            hook(&text);
        }
        if let Some(sink) = sink {
            sink.warnings.lock().unwrap().push(text);
        }
    }
}

/// A hook run on every WARN event, of any thread, with its text.
type Hook = Arc<dyn Fn(&str) + Send + Sync>;

fn hooks() -> &'static Mutex<HashMap<u64, Hook>> {
    static HOOKS: OnceLock<Mutex<HashMap<u64, Hook>>> = OnceLock::new();
    HOOKS.get_or_init(Mutex::default)
}

/// Runs `hook` on every WARN event of any thread, as it is emitted (in
/// the emitting code's own steps), until the guard drops: for a test
/// that must act at the very moment lockkit warns.
pub fn on_warning(hook: impl Fn(&str) + Send + Sync + 'static) -> HookGuard {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let _ = sinks(); // the subscriber, installed
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    hooks().lock().unwrap().insert(id, Arc::new(hook));
    HookGuard(id)
}

/// Removes its hook when dropped.
#[derive(Debug)]
pub struct HookGuard(u64);

impl Drop for HookGuard {
    fn drop(&mut self) {
        hooks().lock().unwrap().remove(&self.0);
    }
}

/// Captures what this thread emits until the guard drops. The test body
/// and the lock calls it awaits run on the test's thread (`block_on`).
pub fn capture() -> (Captured, Guard) {
    let captured = Captured::default();
    let id = std::thread::current().id();
    sinks().lock().unwrap().insert(id, captured.clone());
    (captured, Guard(id))
}

/// Stops capturing for its thread when dropped.
#[derive(Debug)]
pub struct Guard(ThreadId);

impl Drop for Guard {
    fn drop(&mut self) {
        sinks().lock().unwrap().remove(&self.0);
    }
}
