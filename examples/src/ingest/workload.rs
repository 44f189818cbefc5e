//! The event stream: rounds of one batch per worker, where every duplicate
//! key is dealt to two different workers in the same round, so the two
//! copies arrive at the same moment.

use uuid::Uuid;

/// The events of one study run, already dealt to workers.
#[derive(Debug, Clone)]
pub struct Workload {
    /// `rounds[r][w]`: the business keys worker `w` ingests in round `r`,
    /// in arrival order.
    pub rounds: Vec<Vec<Vec<Uuid>>>,
    /// Events in the stream, duplicates included.
    pub events: usize,
    /// Distinct business keys: the rows an exactly-once ingest must leave.
    pub distinct: usize,
    /// Events that are a second copy of a key another worker receives in
    /// the same round.
    pub duplicates: usize,
}

impl Workload {
    /// Generates `events` events (rounded up to whole rounds of
    /// `workers × batch`) from `seed`. A fraction `duplicate_rate` of them
    /// (at most 0.5) are second copies: each such key goes to two different
    /// workers' batches of the same round, at random positions.
    ///
    /// # Panics
    ///
    /// When `workers` or `batch` is 0, or `duplicate_rate` is outside
    /// `0.0..=0.5`, or positive with a single worker.
    pub fn generate(
        workers: usize,
        events: usize,
        batch: usize,
        duplicate_rate: f64,
        seed: u64,
    ) -> Workload {
        assert!(
            workers > 0 && batch > 0,
            "workers and batch must be positive"
        );
        assert!(
            (0.0..=0.5).contains(&duplicate_rate),
            "the duplicate rate must be between 0 and 0.5"
        );
        assert!(
            workers > 1 || duplicate_rate == 0.0,
            "duplicates go to two different workers: use at least 2 workers"
        );
        let mut rng = fastrand::Rng::with_seed(seed);
        let per_round = workers * batch;
        let rounds = events.div_ceil(per_round).max(1);
        let pairs = (per_round as f64 * duplicate_rate).round() as usize;
        let mut all = Vec::with_capacity(rounds);
        let (mut distinct, mut duplicates) = (0, 0);
        for _ in 0..rounds {
            let mut batches: Vec<Vec<Uuid>> =
                (0..workers).map(|_| Vec::with_capacity(batch)).collect();
            for _ in 0..pairs {
                let open: Vec<usize> = (0..workers).filter(|w| batches[*w].len() < batch).collect();
                if open.len() < 2 {
                    break;
                }
                let i = rng.usize(..open.len());
                let mut j = rng.usize(..open.len() - 1);
                if j >= i {
                    j += 1;
                }
                let key = random_uuid(&mut rng);
                batches[open[i]].push(key);
                batches[open[j]].push(key);
                distinct += 1;
                duplicates += 1;
            }
            for b in &mut batches {
                while b.len() < batch {
                    b.push(random_uuid(&mut rng));
                    distinct += 1;
                }
                rng.shuffle(b);
            }
            all.push(batches);
        }
        Workload {
            rounds: all,
            events: rounds * per_round,
            distinct,
            duplicates,
        }
    }
}

/// A version 4 UUID from the seeded generator.
fn random_uuid(rng: &mut fastrand::Rng) -> Uuid {
    uuid::Builder::from_random_bytes(rng.u128(..).to_le_bytes()).into_uuid()
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;

    #[test]
    fn duplicates_go_to_two_workers_of_one_round() {
        let w = Workload::generate(4, 4000, 100, 0.1, 7);
        assert_eq!(w.events, 4000);
        assert_eq!(w.duplicates, 400);
        assert_eq!(w.distinct, 3600);
        let mut seen = HashSet::new();
        for round in &w.rounds {
            let mut workers_of: HashMap<Uuid, Vec<usize>> = HashMap::new();
            for (worker, batch) in round.iter().enumerate() {
                assert_eq!(batch.len(), 100);
                for k in batch {
                    workers_of.entry(*k).or_default().push(worker);
                }
            }
            for (key, workers) in workers_of {
                assert!(seen.insert(key), "a key appears in two rounds");
                match workers.as_slice() {
                    [_] => {}
                    [a, b] => assert_ne!(a, b, "both copies went to one worker"),
                    _ => panic!("a key has more than two copies"),
                }
            }
        }
        assert_eq!(seen.len(), w.distinct);
    }

    #[test]
    fn same_seed_same_stream() {
        let a = Workload::generate(3, 900, 50, 0.2, 42);
        let b = Workload::generate(3, 900, 50, 0.2, 42);
        assert_eq!(a.rounds, b.rounds);
        let c = Workload::generate(3, 900, 50, 0.2, 43);
        assert_ne!(a.rounds, c.rounds);
    }
}
