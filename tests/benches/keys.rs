//! Key derivation: what `lock_key()` costs for typical key types, next to
//! sqlx's `PgAdvisoryLock::new(name)` for comparison. What the lock engine
//! adds to a call is measured with the server, in the paired report of
//! `locks`: its types are lockkit's own, and only lockkit makes a guard.
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
use lockkit::{AdvisoryKey, KeySpec};
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
    c.final_summary();
}
