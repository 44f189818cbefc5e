//! Key derivation: what `lock_key()` costs for typical key types, next to
//! sqlx's `PgAdvisoryLock::new(name)` for comparison; and the lock engine's
//! own work for a one-key call, with no server (group `engine`): what that
//! work costs when its code and data are warm in the caches, to set against
//! what the same call adds in the paired report of `locks`.
//!
//! ```text
//! cargo bench -p lockkit-tests --bench keys                         # lockkit only
//! cargo bench -p lockkit-tests --bench keys --features sqlx-compare # and sqlx
//! ```
//!
//! The sqlx comparison sits behind a feature so that `cargo test` and CI do
//! not build sqlx-core and its ~60 extra crates for one benchmark.

use std::hint::black_box;
use std::time::Duration;

use criterion::Criterion;
use lockkit::driver::Policy;
use lockkit::driver::{Reply, TxState};
use lockkit::{AdvisoryKey, Config, KeySpec, Mode, ServerFacts};
use lockkit_tests::fixtures::{Document, Posting, StripedEvent, Tenanted, TenantedPair};

fn keys(c: &mut Criterion) {
    let mut group = c.benchmark_group("keys");
    let document = Document {
        id: uuid::Uuid::from_u128(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff),
    };
    group.bench_function("uuid", |b| b.iter(|| black_box(&document).lock_key()));

    let tenanted = Tenanted {
        tenant: "acme".into(),
        id: 1001,
    };
    group.bench_function("string_u64", |b| b.iter(|| black_box(&tenanted).lock_key()));

    let posting = Posting {
        account: 42,
        currency: "EUR".into(),
        day: 20_250_101,
        reversal: false,
        batch: Some(uuid::Uuid::from_u128(7)),
    };
    group.bench_function("five_fields", |b| b.iter(|| black_box(&posting).lock_key()));

    let pair = TenantedPair {
        tenant: "acme".into(),
        id: 1001,
    };
    group.bench_function("string_u64_pair", |b| {
        b.iter(|| black_box(&pair).lock_key())
    });

    let striped = StripedEvent {
        business_key: "a1b2c3d4".into(),
    };
    group.bench_function("striped", |b| b.iter(|| black_box(&striped).lock_key()));

    // Where the time goes: the namespace hash alone, recomputed per key.
    let spec = KeySpec::new("Tenanted");
    group.bench_function("ns_hash_only", |b| b.iter(|| black_box(&spec).ns_hash()));
    group.finish();

    #[cfg(feature = "sqlx-compare")]
    sqlx(c);
}

/// One untimed lock of one key through the engine, as an adapter drives it
/// (a new transaction's state, the request, its one statement, the
/// granted reply, the outcome, the guard), with the reply made up instead
/// of sent: the engine's bookkeeping alone, warm.
fn engine(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine");
    let policy = Policy::new(Config::default(), ServerFacts::assumed(64, 100, 0));
    let tenanted = Tenanted {
        tenant: "acme".into(),
        id: 1001,
    };
    group.bench_function("one_key_call", |b| {
        b.iter(|| {
            let state = TxState::new();
            let key = (black_box(&tenanted), Mode::Exclusive);
            let mut call = state
                .acquire_one(&policy, 0, key, false, None)
                .expect("nothing refuses it");
            let statement = call.statement().expect("one statement");
            let granted = Reply::Locked {
                tag: statement.sql().tag().expect("a lock statement has a tag"),
            };
            call.receive(Ok(()), |_, ()| granted);
            let grant = call.finish().expect("granted").expect("not busy");
            black_box(grant.held(black_box(&tenanted)).is_ok())
        })
    });
    group.finish();
}

/// sqlx 0.8's `PgAdvisoryLock::new`: HKDF-SHA256 of the name, truncated to a
/// BigInt key. sqlx takes a string, so a `(tenant, id)` key must first be
/// formatted; both the bare derivation and the realistic one are measured.
#[cfg(feature = "sqlx-compare")]
fn sqlx(c: &mut Criterion) {
    use sqlx_postgres::PgAdvisoryLock;

    let mut group = c.benchmark_group("sqlx");
    group.bench_function("new_str", |b| {
        b.iter(|| {
            PgAdvisoryLock::new(black_box("Tenanted:acme:1001"))
                .key()
                .clone()
        })
    });
    let (tenant, id) = (String::from("acme"), 1001_u64);
    group.bench_function("new_formatted_string_u64", |b| {
        b.iter(|| {
            let name = format!("Tenanted:{}:{}", black_box(&tenant), black_box(id));
            PgAdvisoryLock::new(name).key().clone()
        })
    });
    group.finish();
}

// `criterion_group!`/`criterion_main!` by hand: the macro's `pub fn` has no
// doc comment, which the workspace lints reject.
fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    keys(&mut c);
    engine(&mut c);
    c.final_summary();
}
