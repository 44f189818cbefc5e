//! Every derived key type is in the program's registry
//! (`lockkit::key::linked_key_types`), generic ones once, with its spec (issue
//! 29): `lockkit inspect` and `Locker::publish_key_types` name types from it.

use std::marker::PhantomData;

use lockkit::inspect::KeyRegistry;
use lockkit::key::KeyForm;
use lockkit::{AdvisoryKey, KeySpec};

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "lockkit-tests/linked.plain")]
struct Plain {
    id: i64,
}

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "lockkit-tests/linked.generic", pair, class = 12)]
struct Generic<'a, T: lockkit::key::KeyPart> {
    tenant: &'a str,
    id: T,
    #[advisory_key(skip)]
    _marker: PhantomData<T>,
}

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "lockkit-tests/linked.job")]
enum Job {
    Account(i64),
    Report,
}

fn find(namespace: &str) -> Vec<&'static lockkit::key::LinkedKeyType> {
    lockkit::key::linked_key_types()
        .filter(|t| t.spec().namespace() == namespace)
        .collect()
}

#[test]
fn derived_types_are_linked_with_their_specs() {
    let plain = find("lockkit-tests/linked.plain");
    assert_eq!(plain.len(), 1);
    assert_eq!(plain[0].name(), format!("{}::Plain", module_path!()));
    assert_eq!(plain[0].spec(), Plain::KEY_SPEC);

    // Used at two instantiations, registered once.
    let _ = (
        Generic::<i64> {
            tenant: "a",
            id: 1,
            _marker: PhantomData,
        }
        .lock_key(),
        Generic::<u32> {
            tenant: "a",
            id: 1,
            _marker: PhantomData,
        }
        .lock_key(),
    );
    let generic = find("lockkit-tests/linked.generic");
    assert_eq!(generic.len(), 1);
    assert_eq!(generic[0].name(), format!("{}::Generic", module_path!()));
    assert_eq!(generic[0].spec().form(), KeyForm::Pair);
    assert_eq!(generic[0].spec().pair_class(), 12);

    let job = find("lockkit-tests/linked.job");
    assert_eq!(job.len(), 1);
    let key = Job::Account(7).lock_key();
    let registry = KeyRegistry::linked();
    assert_eq!(
        registry.decode(key)[0].namespace(),
        "lockkit-tests/linked.job"
    );
    assert_eq!(
        registry.decode(Job::Report.lock_key())[0].name(),
        format!("{}::Job", module_path!())
    );
    // The registry's decode agrees with the spec's own tag.
    assert_eq!(
        key.tag(),
        Some(KeySpec::new("lockkit-tests/linked.job").tag())
    );
}
