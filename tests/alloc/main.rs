//! Computing a lock key never allocates: a counting global allocator around
//! `lock_key()` for each shape of key type.
//!
//! The counter is per thread (a thread-local flag and count), so allocations
//! by the test harness's other threads cannot leak into a measurement; tests
//! in this binary may run in parallel.

// A `#[global_allocator]` needs `unsafe impl GlobalAlloc`; the workspace
// denies `unsafe_code`, which this test binary alone allows. The impl only
// forwards to `System` and bumps a thread-local counter.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;

use lockkit::{AdvisoryKey, KeySpec, LockKey};
use lockkit_tests::fixtures::{Document, Posting, StripedEvent, Tenanted, TenantedPair};

/// `System`, counting the allocations (`alloc`, `alloc_zeroed`, `realloc`)
/// made by a thread while its counting is enabled.
struct Counting;

thread_local! {
    // `const` initialisers without destructors: reading them never allocates
    // and works at any point of a thread's life.
    static ENABLED: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

fn note_allocation() {
    let _ = ENABLED.try_with(|enabled| {
        if enabled.get() {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        }
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees hold; counting touches only `Cell`s.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_allocation();
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_allocation();
        // SAFETY: `ptr` was allocated by `System` (every allocation goes
        // through this forwarder) with `layout`, per the caller's contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as for `realloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` and returns its result with the number of allocations this thread
/// made during it.
fn allocations<R>(f: impl FnOnce() -> R) -> (R, usize) {
    COUNT.with(|c| c.set(0));
    ENABLED.with(|e| e.set(true));
    let out = black_box(f());
    ENABLED.with(|e| e.set(false));
    (out, COUNT.with(Cell::get))
}

/// Asserts that `value.lock_key()` allocates nothing (over several calls) and
/// returns the key.
fn key_without_allocating<K: AdvisoryKey>(value: &K) -> LockKey {
    let (keys, count) = allocations(|| {
        let value = black_box(value);
        [value.lock_key(), value.lock_key(), value.lock_key()]
    });
    assert_eq!(count, 0, "lock_key() allocated {count} times in 3 calls");
    assert!(keys.iter().all(|k| *k == keys[0]));
    keys[0]
}

#[derive(AdvisoryKey)]
enum Resource {
    Order(i64),
    Customer { tenant: String, id: u64 },
    Everything,
}

#[test]
fn control_the_counter_sees_this_threads_allocations() {
    let (s, count) = allocations(|| String::from("x"));
    assert_eq!(count, 1);
    drop(s);
    let (v, count) = allocations(|| {
        let mut v: Vec<u64> = Vec::with_capacity(1);
        v.extend([1, 2, 3]); // grows: a realloc
        v
    });
    assert_eq!(count, 2);
    drop(v);
    // Building the parts buffer (what a key never does) allocates.
    let value = Tenanted {
        tenant: "acme".into(),
        id: 1001,
    };
    let (bytes, count) = allocations(|| lockkit::key::parts_bytes(&value));
    assert!(count >= 1, "parts_bytes allocated {count} times");
    drop(bytes);
    // Nothing is counted while counting is off.
    let (_, count) = allocations(|| ());
    assert_eq!(count, 0);
}

#[test]
fn control_other_threads_are_not_counted() {
    let (joined, count) = allocations(|| {
        // The spawn itself allocates on this thread; what the other thread
        // allocates must not add to it.
        std::thread::scope(|s| {
            s.spawn(|| {
                let v: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
                v.len()
            })
            .join()
        })
    });
    assert_eq!(joined.expect("thread"), 1000);
    assert!(
        count < 1000,
        "counted {count} allocations of another thread"
    );
}

#[test]
fn uuid_key() {
    let id = uuid::Uuid::from_u128(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff);
    let key = key_without_allocating(&Document { id });
    assert_eq!(key, KeySpec::new("Document").key_of(&id));
}

#[test]
fn string_and_u64_key() {
    let value = Tenanted {
        tenant: "acme".into(),
        id: 1001,
    };
    // KEYS.md golden vector: never change.
    assert_eq!(
        key_without_allocating(&value),
        LockKey::BigInt(-297873912991975939)
    );
}

#[test]
fn five_field_key() {
    let batch = uuid::Uuid::from_u128(7);
    let value = Posting {
        account: 42,
        currency: "EUR".into(),
        day: 20_250_101,
        reversal: false,
        batch: Some(batch),
    };
    let key = key_without_allocating(&value);
    assert_eq!(
        key,
        KeySpec::new("Posting").key_of(&(42_i64, "EUR", 20_250_101_u32, false, Some(batch)))
    );
}

#[test]
fn enum_key() {
    let customer = Resource::Customer {
        tenant: "acme".into(),
        id: 1001,
    };
    let key = key_without_allocating(&customer);
    assert_eq!(
        key,
        KeySpec::new("Resource").key_with(|p| {
            p.variant("Customer").put("acme").put(&1001_u64);
        })
    );
    key_without_allocating(&Resource::Order(42));
    key_without_allocating(&Resource::Everything);
}

#[test]
fn striped_key() {
    let value = StripedEvent {
        business_key: "a1b2c3d4".into(),
    };
    // KEYS.md golden vector: never change.
    assert_eq!(
        key_without_allocating(&value),
        LockKey::BigInt(5974306380683673735)
    );
}

#[test]
fn pair_key() {
    let value = TenantedPair {
        tenant: "acme".into(),
        id: 1001,
    };
    // KEYS.md golden vector: never change.
    assert_eq!(
        key_without_allocating(&value),
        LockKey::Pair(-69385857, 474084861)
    );
}

#[test]
fn key_of_a_borrowed_tuple() {
    let tenant = String::from("acme");
    let spec = KeySpec::new("Tenanted");
    let (key, count) = allocations(|| spec.key_of(&(tenant.as_str(), 1001_u64)));
    assert_eq!(count, 0);
    assert_eq!(key, LockKey::BigInt(-297873912991975939));
}
