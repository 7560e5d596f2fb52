//! The tally client: `ops` adds of seeded random amounts to random keys,
//! each answer checked against a model, then every total read back. Prints
//! a JSON report and exits non-zero on any error or wrong answer.

use std::collections::HashMap;

use kintsugi_runtime::Incarnation;
use serde::Deserialize;
use tally_example::tally;

#[derive(Deserialize)]
#[serde(default)]
struct Config {
    seed: u64,
    ops: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self { seed: 1, ops: 2000 }
    }
}

fn main() {
    kintsugi_runtime::run(|rt| {
        let config: Config = rt.config()?;
        let client = tally::Client::connect(rt)?;
        Ok(Incarnation::main(move || {
            let mut x = config.seed | 1;
            let mut model: HashMap<u32, u64> = HashMap::new();
            let (mut errors, mut wrong) = (0u64, 0u64);
            for seq in 1..=config.ops {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let key = (x % 64) as u32;
                let amount = (x >> 8) as u32 % 1000 + 1;
                let expect = model.entry(key).or_default();
                *expect += u64::from(amount);
                match client.add(key, amount, seq) {
                    Ok(total) if total == *expect => {}
                    Ok(_) => wrong += 1,
                    Err(_) => errors += 1,
                }
            }
            for (key, expect) in &model {
                match client.total(*key) {
                    Ok(total) if total == *expect => {}
                    Ok(_) => wrong += 1,
                    Err(_) => errors += 1,
                }
            }
            println!(
                "{}",
                serde_json::json!({"seed": config.seed, "ops": config.ops, "keys": model.len(), "errors": errors, "wrong": wrong})
            );
            anyhow::ensure!(
                errors == 0 && wrong == 0,
                "{errors} errors, {wrong} wrong answers"
            );
            Ok(())
        }))
    })
}
