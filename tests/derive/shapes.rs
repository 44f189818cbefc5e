//! Shapes of key types: tuple and unit structs, enums, nested key types,
//! `skip`, `with`, generics, and pointer types that encode like their target.

use std::borrow::Cow;
use std::rc::Rc;
use std::sync::Arc;

use lockkit::key::{parts_bytes, KeyPart, Parts};
use lockkit::{AdvisoryKey, KeySpec, LockKey};

/// KEYS.md's `Transfer` as a tuple struct: field names are not encoded.
#[derive(AdvisoryKey)]
#[advisory_key(namespace = "Transfer")]
struct TransferTuple(i64, i64);

#[derive(AdvisoryKey)]
struct Global;

#[test]
fn tuple_and_unit_structs() {
    assert_eq!(
        TransferTuple(7, 3).lock_key(),
        LockKey::BigInt(-7316124675795688780)
    );
    assert_eq!(Global.lock_key(), KeySpec::new("Global").key_with(|_| {}));
    assert!(parts_bytes(&Global).is_empty());
}

#[derive(AdvisoryKey)]
enum Resource {
    Order(i64),
    Customer {
        id: i64,
    },
    Everything,
    #[allow(non_camel_case_types)]
    r#type(bool),
}

#[test]
fn enums_encode_the_variant_name_then_its_fields() {
    let ns = KeySpec::new("Resource");
    assert_eq!(
        Resource::Order(42).lock_key(),
        ns.key_with(|p| {
            p.variant("Order").put(&42_i64);
        })
    );
    assert_eq!(
        Resource::Customer { id: 42 }.lock_key(),
        ns.key_with(|p| {
            p.variant("Customer").put(&42_i64);
        })
    );
    assert_eq!(
        Resource::Everything.lock_key(),
        ns.key_with(|p| {
            p.variant("Everything");
        })
    );
    assert_eq!(
        parts_bytes(&Resource::Everything),
        [&[0x0C, 10, 0, 0, 0][..], b"Everything"].concat()
    );
    assert_eq!(
        parts_bytes(&Resource::r#type(true)),
        [&[0x0C, 4, 0, 0, 0][..], b"type", &[4, 1]].concat()
    );
    assert_ne!(
        Resource::Order(42).lock_key(),
        Resource::Customer { id: 42 }.lock_key()
    );
}

#[derive(AdvisoryKey)]
#[allow(dead_code)]
enum Priority {
    Low = 1,
    High = 10,
}

/// Same variant names, other discriminants: the key does not change.
#[derive(AdvisoryKey)]
#[advisory_key(namespace = "Priority")]
#[allow(dead_code)]
enum Renumbered {
    Low = 7,
    High = 3,
}

#[test]
fn enum_discriminants_are_not_encoded() {
    assert_eq!(Priority::Low.lock_key(), Renumbered::Low.lock_key());
    assert_eq!(Priority::High.lock_key(), Renumbered::High.lock_key());
    assert_eq!(
        Priority::High.lock_key(),
        KeySpec::new("Priority").key_with(|p| {
            p.variant("High");
        })
    );
}

/// An enum without variants has no values; it still derives.
#[derive(AdvisoryKey)]
#[allow(dead_code)]
enum Never {}

#[test]
fn empty_enum_derives() {
    fn is_key<T: AdvisoryKey + KeyPart>() -> &'static str {
        T::KEY_SPEC.namespace()
    }
    assert_eq!(is_key::<Never>(), "Never");
}

#[derive(AdvisoryKey)]
struct Order {
    id: i64,
}

#[derive(AdvisoryKey)]
struct Line {
    order: Order,
    line: u32,
}

#[derive(AdvisoryKey)]
struct Shipment {
    lines: Vec<Line>,
    resource: Option<Resource>,
}

#[test]
fn key_types_nest_as_their_fields() {
    // A nested key type contributes its fields, not its namespace.
    let line = Line {
        order: Order { id: 42 },
        line: 3,
    };
    assert_eq!(
        line.lock_key(),
        KeySpec::new("Line").key_of(&(42_i64, 3_u32))
    );
    assert_eq!(parts_bytes(&Order { id: 42 }), parts_bytes(&42_i64));
    let shipment = Shipment {
        lines: vec![line],
        resource: Some(Resource::Order(1)),
    };
    let expected = KeySpec::new("Shipment").key_with(|p| {
        p.put(&vec![(42_i64, 3_u32)]);
        p.put(&Some(())); // `09 01`, then the variant
        p.variant("Order").put(&1_i64);
    });
    assert_eq!(shipment.lock_key(), expected);
}

#[derive(AdvisoryKey)]
struct Cached {
    id: i64,
    #[advisory_key(skip)]
    _hits: Vec<f64>,
    #[advisory_key(skip)]
    _loaded_at: std::time::Instant,
}

#[derive(AdvisoryKey)]
#[allow(dead_code)]
enum Job {
    Run {
        id: i64,
        #[advisory_key(skip)]
        attempt: u32,
    },
}

#[test]
fn skipped_fields_are_not_encoded() {
    let now = std::time::Instant::now();
    let a = Cached {
        id: 42,
        _hits: vec![],
        _loaded_at: now,
    };
    let b = Cached {
        id: 42,
        _hits: vec![1.5, f64::NAN],
        _loaded_at: now,
    };
    assert_eq!(a.lock_key(), b.lock_key());
    assert_eq!(a.lock_key(), KeySpec::new("Cached").key_of(&42_i64));
    assert_ne!(a.lock_key(), Cached { id: 43, ..b }.lock_key());
    assert_eq!(
        Job::Run { id: 1, attempt: 1 }.lock_key(),
        Job::Run { id: 1, attempt: 2 }.lock_key()
    );
    assert_eq!(
        parts_bytes(&Job::Run { id: 1, attempt: 9 }),
        [&[0x0C, 3, 0, 0, 0][..], b"Run", &parts_bytes(&1_i64)].concat()
    );
}

fn cents(amount: &f64, parts: &mut Parts<'_>) {
    parts.put(&((amount * 100.0).round() as i64));
}

mod encoders {
    pub(crate) fn lowercase(name: &str, parts: &mut lockkit::key::Parts<'_>) {
        parts.put(&name.to_lowercase());
    }
}

#[derive(AdvisoryKey)]
struct Payment {
    order: u64,
    #[advisory_key(with = "cents")]
    amount: f64,
}

#[derive(AdvisoryKey)]
enum Account {
    Named(#[advisory_key(with = "encoders::lowercase")] String),
}

#[test]
fn custom_encoders_replace_the_field_encoding() {
    let p = Payment {
        order: 1,
        amount: 19.99,
    };
    assert_eq!(
        p.lock_key(),
        KeySpec::new("Payment").key_of(&(1_u64, 1999_i64))
    );
    assert_eq!(
        Account::Named("ACME".into()).lock_key(),
        Account::Named("acme".into()).lock_key()
    );
    assert_eq!(
        parts_bytes(&Account::Named("Acme".into())),
        [&[0x0C, 5, 0, 0, 0][..], b"Named", &parts_bytes("acme")].concat()
    );
}

#[derive(AdvisoryKey)]
struct Scoped<T> {
    tenant: T,
    id: u64,
}

#[derive(AdvisoryKey)]
struct Tagged<T, M>
where
    T: Clone,
{
    id: Option<T>,
    #[advisory_key(skip)]
    _meta: M,
}

#[derive(AdvisoryKey)]
enum Either<L, R> {
    Left(L),
    Right(Box<R>),
}

#[derive(AdvisoryKey)]
struct Fixed<const N: usize> {
    ids: [u8; N],
}

#[test]
fn generics_need_key_part_only_where_encoded() {
    // Scoped<&str> is KEYS.md's Tenanted under another namespace.
    let borrowed = Scoped {
        tenant: "acme",
        id: 1001,
    };
    let owned = Scoped {
        tenant: String::from("acme"),
        id: 1001,
    };
    assert_eq!(borrowed.lock_key(), owned.lock_key());
    assert_eq!(
        borrowed.lock_key(),
        KeySpec::new("Scoped").key_of(&("acme", 1001_u64))
    );
    // `M = f64` is fine: the field is skipped.
    let tagged = Tagged {
        id: Some(5_u8),
        _meta: 0.5_f64,
    };
    assert_eq!(
        tagged.lock_key(),
        KeySpec::new("Tagged").key_of(&Some(5_i64))
    );
    let e: Either<u8, String> = Either::Right(Box::new("x".into()));
    assert_eq!(
        e.lock_key(),
        KeySpec::new("Either").key_with(|p| {
            p.variant("Right").put("x");
        })
    );
    let l: Either<u8, String> = Either::Left(1);
    assert_eq!(
        l.lock_key(),
        KeySpec::new("Either").key_with(|p| {
            p.variant("Left").put(&1_i64);
        })
    );
    assert_ne!(
        l.lock_key(),
        Either::<String, u8>::Right(Box::new(1)).lock_key()
    );
    assert_eq!(
        Fixed { ids: [1, 2] }.lock_key(),
        KeySpec::new("Fixed").key_of(&[1_i64, 2])
    );
}

/// One namespace, many field types that must encode alike.
mod pointers {
    use super::*;

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Named")]
    pub(super) struct Owned {
        pub(super) name: String,
        pub(super) id: i64,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Named")]
    pub(super) struct Borrowed<'a> {
        pub(super) name: &'a str,
        pub(super) id: &'a i64,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Named")]
    pub(super) struct Cowed<'a> {
        pub(super) name: Cow<'a, str>,
        pub(super) id: Cow<'a, i64>,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Named")]
    pub(super) struct Shared {
        pub(super) name: Arc<str>,
        pub(super) id: Rc<i64>,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Named")]
    pub(super) struct Boxed {
        pub(super) name: Box<str>,
        pub(super) id: Box<i64>,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(namespace = "Named")]
    pub(super) struct Narrow<'a> {
        pub(super) name: &'a String,
        pub(super) id: u16,
    }
}

#[test]
fn pointers_and_borrows_equal_owned() {
    use pointers::*;
    let owned = Owned {
        name: "acme".into(),
        id: 7,
    }
    .lock_key();
    let name = String::from("acme");
    assert_eq!(
        Borrowed {
            name: &name,
            id: &7
        }
        .lock_key(),
        owned
    );
    assert_eq!(
        Cowed {
            name: Cow::Borrowed("acme"),
            id: Cow::Owned(7)
        }
        .lock_key(),
        owned
    );
    assert_eq!(
        Cowed {
            name: Cow::Owned(name.clone()),
            id: Cow::Borrowed(&7)
        }
        .lock_key(),
        owned
    );
    assert_eq!(
        Shared {
            name: Arc::from("acme"),
            id: Rc::new(7)
        }
        .lock_key(),
        owned
    );
    assert_eq!(
        Boxed {
            name: "acme".into(),
            id: Box::new(7)
        }
        .lock_key(),
        owned
    );
    assert_eq!(Narrow { name: &name, id: 7 }.lock_key(), owned);
    assert_ne!(Narrow { name: &name, id: 8 }.lock_key(), owned);
}

#[derive(AdvisoryKey)]
struct Document {
    id: uuid::Uuid,
}

#[test]
fn uuid_fields() {
    let id = uuid::Uuid::from_u128(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff);
    let bytes = parts_bytes(&Document { id });
    assert_eq!(bytes[0], 0x08);
    assert_eq!(&bytes[1..], id.as_bytes());
    assert_eq!(
        Document { id }.lock_key(),
        KeySpec::new("Document").key_of(&id)
    );
}
