//! The system description format: the shipped files, start order, and every
//! error kind with its exact `path:line:col: message`.

use std::path::Path;
use std::time::Duration;

use kintsugi_system::{
    parse, Capability, ErrorKind, GiveUpAction, GroupStrategy, HangAction, Location, RebootMode,
    RecoveryMode, RestartGroup, RestartPolicy, RestartType, SpinPolicy, Sysno, Use, VaultQuota,
};

const DEMO: &str = include_str!("../../../systems/demo.toml");
const BENCH: &str = include_str!("../../../systems/bench.toml");

/// Lines 1–3; components start at line 4.
const HEAD: &str = "[system]\nname = \"t\"\n\n";

fn err(text: &str) -> (String, ErrorKind) {
    match parse(Path::new("sys.toml"), text) {
        Ok(s) => panic!("expected an error, parsed {s:#?}"),
        Err(e) => (e.to_string(), e.kind().expect("a parse error has a kind")),
    }
}

fn err_with_head(body: &str) -> (String, ErrorKind) {
    err(&format!("{HEAD}{body}"))
}

#[test]
fn demo_parses_in_start_order() {
    let s = parse(Path::new("systems/demo.toml"), DEMO).unwrap();
    assert_eq!(s.name, "demo");
    assert_eq!(s.description, "ramfs with a verifying file workload");
    assert_eq!(s.path, Path::new("systems/demo.toml"));
    let names: Vec<&str> = s.components.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["ramfs", "workload"]);

    let ramfs = s.component("ramfs").unwrap();
    assert_eq!(ramfs.id, 1);
    assert_eq!(ramfs.binary, Path::new("kintsugi-ramfs"));
    assert_eq!(ramfs.provides, ["fs"]);
    assert!(ramfs.uses.is_empty());
    assert_eq!(ramfs.priority, 0);
    assert_eq!(ramfs.recovery, RecoveryMode::OnDemand);
    assert_eq!(ramfs.reboot, RebootMode::Standby);
    assert_eq!(
        ramfs.restart,
        RestartPolicy {
            max: 1000,
            window: Duration::from_millis(1000),
            ..RestartPolicy::default()
        }
    );
    assert_eq!(ramfs.slots, 8);
    assert_eq!(ramfs.capabilities, [], "only priorities, by default");
    assert_eq!(
        (ramfs.realtime, ramfs.arena_kib, ramfs.pool_kib),
        (None, 0, 0),
        "no real-time priority and no durable memory unless asked"
    );
    assert_eq!(ramfs.config, serde_json::json!({}));

    let w = s.component("workload").unwrap();
    assert_eq!(w.id, 2);
    assert_eq!(w.binary, Path::new("kintsugi-fs-workload"));
    assert_eq!(
        w.uses,
        [Use {
            interface: "fs".into(),
            server: "ramfs".into()
        }]
    );
    assert_eq!(w.restart, RestartPolicy::default());
    assert_eq!(w.restart.max, 5);
    assert_eq!(w.restart.window, Duration::from_millis(1000));
    assert_eq!(w.slots, 8);
    assert_eq!(w.config, serde_json::json!({ "files": 16, "seed": 42 }));
    assert!(s.component("nope").is_none());
}

#[test]
fn bench_parses() {
    let s = parse(Path::new("systems/bench.toml"), BENCH).unwrap();
    assert_eq!(s.name, "bench");
    assert_eq!(s.components.len(), 1);
    let echo = &s.components[0];
    assert_eq!((echo.id, echo.name.as_str()), (1, "echo"));
    assert_eq!(echo.binary, Path::new("kintsugi-bench-echo"));
    assert_eq!(echo.provides, ["bench"]);
}

#[test]
fn start_order_is_topological_and_stable() {
    // File order: app (uses fs, log), other, fs (uses blk), log, blk.
    let text = format!(
        "{HEAD}\
[[component]]\nname = \"app\"\nbinary = \"app\"\nuses = [\"fs\", \"log\"]\n\
[[component]]\nname = \"other\"\nbinary = \"o\"\n\
[[component]]\nname = \"fs\"\nbinary = \"f\"\nprovides = [\"fs\"]\nuses = [\"blk\"]\n\
[[component]]\nname = \"log\"\nbinary = \"l\"\nprovides = [\"log\"]\n\
[[component]]\nname = \"blk\"\nbinary = \"b\"\nprovides = [\"blk\"]\n"
    );
    let s = parse(Path::new("x.toml"), &text).unwrap();
    let order: Vec<(u32, &str)> = s
        .components
        .iter()
        .map(|c| (c.id, c.name.as_str()))
        .collect();
    assert_eq!(
        order,
        [(2, "other"), (4, "log"), (5, "blk"), (3, "fs"), (1, "app")]
    );
    let clients: Vec<&str> = s.clients_of("fs").map(|c| c.name.as_str()).collect();
    assert_eq!(clients, ["app"]);
    assert_eq!(s.component("app").unwrap().server_of("log"), Some("log"));
}

#[test]
fn explicit_provider_and_modes() {
    let text = format!(
        "{HEAD}\
[[component]]\nname = \"a\"\nbinary = \"a\"\nprovides = [\"fs\"]\nrecovery = \"eager\"\nreboot = \"fork\"\npriority = -20\nslots = 64\n\
[[component]]\nname = \"b\"\nbinary = \"b\"\nprovides = [\"fs\"]\nreboot = \"exec\"\npriority = 19\nslots = 1\nrestart = {{ window_ms = 50 }}\n\
[[component]]\nname = \"c\"\nbinary = \"c\"\nuses = [\"fs@b\"]\nconfig = {{ nested = {{ x = [1.5, \"s\", true] }}, when = 1979-05-27 }}\n"
    );
    let mut s = parse(Path::new("x.toml"), &text).unwrap();
    let a = s.component("a").unwrap();
    assert_eq!(
        (a.recovery, a.reboot, a.priority, a.slots),
        (RecoveryMode::Eager, RebootMode::Fork, -20, 64)
    );
    let b = s.component("b").unwrap();
    assert_eq!(
        (b.recovery, b.reboot, b.priority, b.slots),
        (RecoveryMode::OnDemand, RebootMode::Exec, 19, 1)
    );
    assert_eq!(
        b.restart,
        RestartPolicy {
            max: 5,
            window: Duration::from_millis(50),
            ..RestartPolicy::default()
        }
    );
    let c = s.component_mut("c").unwrap();
    assert_eq!(
        c.uses,
        [Use {
            interface: "fs".into(),
            server: "b".into()
        }]
    );
    assert_eq!(
        c.config,
        serde_json::json!({ "nested": { "x": [1.5, "s", true] }, "when": "1979-05-27" })
    );
    c.set_config("when", serde_json::json!(7));
    c.set_config("new", serde_json::json!("v"));
    c.set_restart(3, Duration::from_secs(2));
    let c = s.component("c").unwrap();
    assert_eq!(c.config["when"], 7);
    assert_eq!(c.config["new"], "v");
    assert_eq!(
        c.restart,
        RestartPolicy {
            max: 3,
            window: Duration::from_secs(2),
            ..RestartPolicy::default()
        }
    );
    let json = serde_json::to_value(&s).unwrap();
    assert_eq!(
        json["components"][2]["restart"],
        serde_json::json!({
            "max": 3,
            "window_ms": 2000,
            "type": "transient",
            "on_give_up": "stop",
            "backoff": { "after": 3, "first_ms": 10, "max_ms": 1000, "healthy_ms": 1000 }
        })
    );
    assert_eq!(json["components"][0]["recovery"], "eager");
}

#[test]
fn durable_memory_and_realtime() {
    let text = format!(
        "{HEAD}\
[[component]]\nname = \"mm\"\nbinary = \"mm\"\nprovides = [\"mem\"]\npool_kib = 1048576\narena_kib = 4\nrealtime = 99\n\
[[component]]\nname = \"app\"\nbinary = \"app\"\nuses = [\"mem\"]\narena_kib = 0\nrealtime = 1\npool_kib = 0\n"
    );
    let s = parse(Path::new("x.toml"), &text).unwrap();
    let mm = s.component("mm").unwrap();
    assert_eq!(
        (mm.arena_kib, mm.pool_kib, mm.realtime),
        (4, 1 << 20, Some(99))
    );
    let app = s.component("app").unwrap();
    assert_eq!((app.arena_kib, app.pool_kib, app.realtime), (0, 0, Some(1)));
    let json = serde_json::to_value(&s).unwrap();
    assert_eq!(json["components"][0]["pool_kib"], 1 << 20);
    assert_eq!(json["components"][0]["realtime"], 99);
}

#[test]
fn checkpoint_policy() {
    let text = format!(
        "{HEAD}\
[[component]]\nname = \"kv\"\nbinary = \"kv\"\ncheckpoint = {{ every_ms = 100, keep = 3, on_hang = \"rollback\" }}\n\
[[component]]\nname = \"app\"\nbinary = \"app\"\ncheckpoint = {{ every_ms = 10 }}\n\
[[component]]\nname = \"plain\"\nbinary = \"plain\"\n"
    );
    let s = parse(Path::new("x.toml"), &text).unwrap();
    let kv = s.component("kv").unwrap().checkpoint.unwrap();
    assert_eq!(
        (kv.every, kv.keep, kv.on_hang),
        (Duration::from_millis(100), 3, HangAction::Rollback)
    );
    let app = s.component("app").unwrap().checkpoint.unwrap();
    assert_eq!(
        (app.every, app.keep, app.on_hang),
        (Duration::from_millis(10), 0, HangAction::Reboot)
    );
    assert_eq!(s.component("plain").unwrap().checkpoint, None);
    let json = serde_json::to_value(&s).unwrap();
    assert_eq!(json["components"][0]["checkpoint"]["every_ms"], 100);

    let (msg, kind) =
        err_with_head("[[component]]\nname = \"a\"\nbinary = \"a\"\ncheckpoint = { keep = 1 }\n");
    assert_eq!(kind, ErrorKind::Syntax);
    assert!(msg.starts_with("sys.toml:7:"), "{msg}");
    assert!(msg.contains("every_ms"), "{msg}");
    let (msg, kind) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\ncheckpoint = { every_ms = 5, on_hang = \"retry\" }\n",
    );
    assert_eq!(kind, ErrorKind::Syntax);
    assert!(msg.starts_with("sys.toml:7:"), "{msg}");
    assert!(msg.contains("rollback"), "the choices are named: {msg}");
}

#[test]
fn checkpoint_recovery_brings_a_policy_and_a_journal() {
    let text = format!(
        "{HEAD}\
[[component]]\nname = \"kv\"\nbinary = \"kv\"\nrecovery = \"checkpoint\"\n\
[[component]]\nname = \"big\"\nbinary = \"big\"\nrecovery = \"checkpoint\"\njournal_kib = 2048\ncheckpoint = {{ every_ms = 10, on_hang = \"reboot\" }}\n\
[[component]]\nname = \"plain\"\nbinary = \"plain\"\n"
    );
    let s = parse(Path::new("x.toml"), &text).unwrap();
    let kv = s.component("kv").unwrap();
    assert_eq!(kv.recovery, RecoveryMode::Checkpoint);
    assert_eq!(kv.journal_kib, 16 * 1024, "a default log");
    let p = kv.checkpoint.expect("a default policy");
    assert_eq!(
        (p.every, p.keep, p.on_hang),
        (Duration::from_millis(100), 0, HangAction::Rollback)
    );
    let big = s.component("big").unwrap();
    assert_eq!(big.journal_kib, 2048);
    assert_eq!(
        big.checkpoint.unwrap().on_hang,
        HangAction::Reboot,
        "as written"
    );
    assert_eq!(s.component("plain").unwrap().journal_kib, 0);

    let (msg, kind) =
        err_with_head("[[component]]\nname = \"a\"\nbinary = \"a\"\njournal_kib = 4096\n");
    assert_eq!(kind, ErrorKind::InvalidConfig);
    assert!(msg.starts_with("sys.toml:7:"), "{msg}");
    assert!(msg.contains("recovery = \"checkpoint\""), "{msg}");
    let (msg, kind) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\nrecovery = \"checkpoint\"\njournal_kib = 10\n",
    );
    assert_eq!(kind, ErrorKind::OutOfRange);
    assert!(msg.starts_with("sys.toml:8:"), "{msg}");
}

#[test]
fn restart_groups() {
    let comps = "[[component]]\nname = \"a\"\nbinary = \"a\"\n[[component]]\nname = \"b\"\nbinary = \"b\"\n[[component]]\nname = \"c\"\nbinary = \"c\"\n";
    let s = parse(
        Path::new("x.toml"),
        &format!("{HEAD}{comps}[[group]]\nname = \"g\"\nmembers = [\"a\", \"b\", \"c\"]\nstrategy = \"rest_for_one\"\n"),
    )
    .unwrap();
    let g = &s.groups[0];
    assert_eq!(
        (g.name.as_str(), g.strategy),
        ("g", GroupStrategy::RestForOne)
    );
    assert_eq!(g.restarted_with("a"), ["b", "c"]);
    assert_eq!(g.restarted_with("b"), ["c"]);
    assert!(g.restarted_with("c").is_empty());
    assert!(g.restarted_with("z").is_empty());
    let all = RestartGroup {
        strategy: GroupStrategy::OneForAll,
        ..g.clone()
    };
    assert_eq!(all.restarted_with("b"), ["a", "c"]);
    for (group, message) in [
        (
            "[[group]]\nname = \"g\"\nmembers = [\"a\", \"z\"]\nstrategy = \"one_for_all\"\n",
            "group `g` names `z`, which is not a component",
        ),
        (
            "[[group]]\nname = \"g\"\nmembers = [\"a\"]\nstrategy = \"one_for_all\"\n",
            "group `g` needs at least two members",
        ),
        (
            "[[group]]\nname = \"g\"\nmembers = [\"a\", \"b\"]\nstrategy = \"one_for_all\"\n[[group]]\nname = \"h\"\nmembers = [\"c\", \"b\"]\nstrategy = \"one_for_all\"\n",
            "component `b` is in more than one group",
        ),
        (
            "[[group]]\nname = \"g\"\nmembers = [\"a\", \"b\"]\nstrategy = \"all\"\n",
            "unknown variant `all`, expected `one_for_all` or `rest_for_one`",
        ),
    ] {
        let (msg, _) = err_with_head(&format!("{comps}{group}"));
        assert!(msg.starts_with("sys.toml:"), "{msg}");
        assert!(msg.contains(message), "{msg}");
    }
}

#[test]
fn capabilities_are_named_and_replace_the_default() {
    let s = parse(
        Path::new("x.toml"),
        &format!("{HEAD}[[component]]\nname = \"n\"\nbinary = \"n\"\ncapabilities = [\"sys_ptrace\", \"net_bind_service\"]\n[[component]]\nname = \"bare\"\nbinary = \"b\"\ncapabilities = []\n"),
    )
    .unwrap();
    let n = s.component("n").unwrap();
    assert_eq!(
        n.capabilities,
        [Capability::SysPtrace, Capability::NetBindService]
    );
    assert_eq!(
        n.capabilities
            .iter()
            .map(|c| c.number())
            .collect::<Vec<_>>(),
        [19, 10]
    );
    assert!(s.component("bare").unwrap().capabilities.is_empty());
    assert_eq!(
        (n.start_timeout, n.stop_timeout),
        (None, None),
        "the supervisor's defaults"
    );
    let t = parse(
        Path::new("x.toml"),
        &format!("{HEAD}[[component]]\nname = \"t\"\nbinary = \"t\"\nstart_timeout_ms = 500\nstop_timeout_ms = 0\n"),
    )
    .unwrap();
    let t = t.component("t").unwrap();
    assert_eq!(
        (t.start_timeout, t.stop_timeout),
        (Some(Duration::from_millis(500)), Some(Duration::ZERO))
    );
    assert_eq!(n.vault_quota, VaultQuota::default());
    let q = parse(
        Path::new("x.toml"),
        &format!("{HEAD}[[component]]\nname = \"q\"\nbinary = \"q\"\nvault_quota = {{ records = 10, kib = 4, fds = 0 }}\n"),
    )
    .unwrap();
    assert_eq!(
        q.component("q").unwrap().vault_quota,
        VaultQuota {
            records: 10,
            bytes: 4096,
            fds: 0
        }
    );
    let (msg, _) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\nvault_quota = { records = -1 }\n",
    );
    assert_eq!(
        msg,
        "sys.toml:7:27: component `a`: vault_quota.records -1 is out of range (0..=1099511627776)"
    );
    let (msg, _) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\ncapabilities = [\"sys_admin\"]\n",
    );
    assert!(msg.starts_with("sys.toml:7:"), "{msg}");
    assert!(msg.contains("unknown variant `sys_admin`"), "{msg}");
    let s = parse(
        Path::new("x.toml"),
        &format!("{HEAD}[[component]]\nname = \"n\"\nbinary = \"n\"\nsockets = {{ listen = \"http\" }}\n"),
    )
    .unwrap();
    assert_eq!(
        s.component("n").unwrap().sockets,
        [("listen".to_string(), "http".to_string())].into()
    );
    let (msg, _) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\nsockets = { listen = \"a:b\" }\n",
    );
    assert!(
        msg.starts_with("sys.toml:7:22: component `a`: sockets.listen = \"a:b\""),
        "{msg}"
    );
}

#[test]
fn restart_policy_give_up_and_backoff() {
    let text = format!(
        "{HEAD}\
[[component]]\nname = \"leaf\"\nbinary = \"a\"\nrestart = {{ on_give_up = \"isolate\", backoff_after = 2, backoff_ms = 5, healthy_ms = 200 }}\n\
[[component]]\nname = \"eager\"\nbinary = \"b\"\nrestart = {{ backoff = false, type = \"permanent\" }}\n\
[[component]]\nname = \"slow\"\nbinary = \"c\"\nrestart = {{ backoff_ms = 5000 }}\n"
    );
    let s = parse(Path::new("x.toml"), &text).unwrap();
    let leaf = s.component("leaf").unwrap().restart;
    assert_eq!(leaf.on_give_up, GiveUpAction::Isolate);
    let b = leaf.backoff.unwrap();
    assert_eq!(
        (b.after, b.first, b.max, b.healthy),
        (
            2,
            Duration::from_millis(5),
            Duration::from_millis(1000),
            Duration::from_millis(200)
        )
    );
    // Two failures the same way restart at once; then 5, 10, 20 ms … up to 1 s.
    let delays: Vec<u64> = (1..=12).map(|n| b.delay(n).as_millis() as u64).collect();
    assert_eq!(delays, [0, 0, 5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
    assert_eq!(b.delay(u32::MAX), Duration::from_millis(1000));
    let eager = s.component("eager").unwrap().restart;
    assert_eq!(
        (eager.on_give_up, eager.backoff),
        (GiveUpAction::Stop, None)
    );
    assert_eq!(eager.kind, RestartType::Permanent);
    assert_eq!(leaf.kind, RestartType::Transient, "the default");
    let slow = s.component("slow").unwrap().restart.backoff.unwrap();
    assert_eq!(
        slow.max,
        Duration::from_millis(5000),
        "the max rises to the first delay"
    );
    let (msg, _) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\nrestart = { on_give_up = \"ignore\" }\n",
    );
    assert!(
        msg.contains("unknown variant `ignore`, expected `stop` or `isolate`"),
        "{msg}"
    );
}

#[test]
fn location_counts_characters_from_one() {
    let t = "ab\ncé\n";
    assert_eq!(Location::of_offset(t, 0), Location { line: 1, col: 1 });
    assert_eq!(Location::of_offset(t, 2), Location { line: 1, col: 3 });
    assert_eq!(Location::of_offset(t, 3), Location { line: 2, col: 1 });
    assert_eq!(Location::of_offset(t, 6), Location { line: 2, col: 3 }); // after 'é' (2 bytes)
    assert_eq!(Location::of_offset(t, 5), Location { line: 2, col: 2 }); // inside 'é': clamped back
    assert_eq!(Location::of_offset(t, 99), Location { line: 3, col: 1 });
}

// ---- errors ----------------------------------------------------------------

#[test]
fn toml_syntax_error() {
    let (msg, kind) = err("[system\nname = \"x\"\n");
    assert_eq!(kind, ErrorKind::Syntax);
    assert!(
        msg.starts_with("sys.toml:1:8: invalid table header"),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "{msg}");

    let (msg, _) = err("[system]\nname = \"x\nfoo\n");
    assert!(msg.starts_with("sys.toml:2:"), "{msg}");

    let (msg, _) = err("[system]\nname = \"x\"\nname = \"y\"\n");
    assert_eq!(msg, "sys.toml:3:1: duplicate key `name` in table `system`");
}

#[test]
fn unknown_key() {
    let (msg, kind) = err_with_head("[[component]]\nname = \"a\"\nbinary = \"a\"\nfoo = 1\n");
    assert_eq!(kind, ErrorKind::Syntax);
    assert_eq!(
        msg,
        "sys.toml:7:1: unknown field `foo`, expected one of `name`, `binary`, `provides`, `uses`, \
         `priority`, `realtime`, `cpus`, `recovery`, `reboot`, `restart`, `slots`, `arena_kib`, \
         `pool_kib`, `journal_kib`, `capabilities`, `syscalls`, `user`, `vault_quota`, `sockets`, \
         `watchdog`, `start_timeout_ms`, `stop_timeout_ms`, `checkpoint`, `config`"
    );
    let (msg, _) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\nrestart = { max = 1, window = 3 }\n",
    );
    assert_eq!(
        msg,
        "sys.toml:7:22: unknown field `window`, expected one of `max`, `window_ms`, `on_give_up`, `type`, \
         `backoff`, `backoff_after`, `backoff_ms`, `backoff_max_ms`, `healthy_ms`"
    );
    let (msg, _) = err("[system]\nname = \"t\"\nversion = 2\n");
    assert_eq!(
        msg,
        "sys.toml:3:1: unknown field `version`, expected one of `name`, `description`, `spin`, `vault`, `keeper`"
    );
}

#[test]
fn wrong_type() {
    let (msg, kind) =
        err_with_head("[[component]]\nname = \"a\"\nbinary = \"a\"\nslots = \"many\"\n");
    assert_eq!(kind, ErrorKind::Syntax);
    assert_eq!(
        msg,
        "sys.toml:7:9: invalid type: string \"many\", expected an integer"
    );
    let (msg, _) =
        err_with_head("[[component]]\nname = \"a\"\nbinary = \"a\"\nprovides = \"fs\"\n");
    assert!(
        msg.starts_with("sys.toml:7:12: invalid type: string \"fs\", expected a sequence"),
        "{msg}"
    );
    let (msg, _) =
        err_with_head("[[component]]\nname = \"a\"\nbinary = \"a\"\nrecovery = \"lazy\"\n");
    assert_eq!(
        msg,
        "sys.toml:7:12: unknown variant `lazy`, expected one of `on-demand`, `eager`, `checkpoint`"
    );
    let (msg, _) =
        err_with_head("[[component]]\nname = \"a\"\nbinary = \"a\"\narena_kib = \"1M\"\n");
    assert_eq!(
        msg,
        "sys.toml:7:13: invalid type: string \"1M\", expected an integer"
    );
    let (msg, _) = err_with_head("[[component]]\nname = \"a\"\nbinary = \"a\"\nrealtime = 1.5\n");
    assert_eq!(
        msg,
        "sys.toml:7:12: invalid type: floating point `1.5`, expected an integer"
    );
    let (msg, _) = err_with_head("[[component]]\nname = \"a\"\n");
    assert_eq!(msg, "sys.toml:4:1: missing field `binary`");
    let (msg, _) = err("");
    assert_eq!(msg, "sys.toml:1:1: missing field `system`");
}

#[test]
fn duplicate_component_name() {
    let (msg, kind) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\n\n[[component]]\nname = \"a\"\nbinary = \"b\"\n",
    );
    assert_eq!(kind, ErrorKind::DuplicateName);
    assert_eq!(msg, "sys.toml:9:8: duplicate component name `a`");
}

const RAMFS: &str = "[[component]]\nname = \"ramfs\"\nbinary = \"ramfs\"\nprovides = [\"fs\"]\n\n"; // lines 4-8

#[test]
fn unknown_interface() {
    let (msg, kind) = err_with_head(&format!(
        "{RAMFS}[[component]]\nname = \"workload\"\nbinary = \"w\"\nuses = [\"fsx\"]\n"
    ));
    assert_eq!(kind, ErrorKind::UnknownInterface);
    assert_eq!(
        msg,
        "sys.toml:12:9: component `workload` uses interface `fsx`, which no component provides"
    );
}

#[test]
fn ambiguous_provider() {
    let (msg, kind) = err_with_head(&format!(
        "{RAMFS}[[component]]\nname = \"diskfs\"\nbinary = \"d\"\nprovides = [\"fs\"]\n\
         [[component]]\nname = \"workload\"\nbinary = \"w\"\nuses = [\"fs\"]\n"
    ));
    assert_eq!(kind, ErrorKind::AmbiguousProvider);
    assert_eq!(
        msg,
        "sys.toml:16:9: component `workload` uses interface `fs`, which is provided by `ramfs` \
         and `diskfs`: write `fs@ramfs` or `fs@diskfs`"
    );
    // Picking one with `@` leaves only the bare `fs` ambiguous.
    let (msg, kind) = err_with_head(&format!(
        "{RAMFS}[[component]]\nname = \"diskfs\"\nbinary = \"d\"\nprovides = [\"fs\"]\n\
         [[component]]\nname = \"workload\"\nbinary = \"w\"\nuses = [\"fs@diskfs\", \"fs\"]\n"
    ));
    assert_eq!(kind, ErrorKind::AmbiguousProvider);
    assert_eq!(
        msg,
        "sys.toml:16:22: component `workload` uses interface `fs`, which is provided by `ramfs` \
         and `diskfs`: write `fs@ramfs` or `fs@diskfs`"
    );
}

#[test]
fn explicit_provider_that_does_not_provide() {
    let (msg, kind) = err_with_head(&format!(
        "{RAMFS}[[component]]\nname = \"disk\"\nbinary = \"d\"\nprovides = [\"blk\"]\n\
         [[component]]\nname = \"workload\"\nbinary = \"w\"\nuses = [\"fs@disk\"]\n"
    ));
    assert_eq!(kind, ErrorKind::NotProvided);
    assert_eq!(
        msg,
        "sys.toml:16:9: component `workload` uses interface `fs` from `disk`, which does not provide it"
    );
    let (msg, kind) = err_with_head(&format!(
        "{RAMFS}[[component]]\nname = \"workload\"\nbinary = \"w\"\nuses = [\"fs@ramfsx\"]\n"
    ));
    assert_eq!(kind, ErrorKind::UnknownComponent);
    assert_eq!(
        msg,
        "sys.toml:12:9: component `workload` uses `fs@ramfsx`, but there is no component `ramfsx`"
    );
}

#[test]
fn self_use() {
    let (msg, kind) = err_with_head(
        "[[component]]\nname = \"ramfs\"\nbinary = \"ramfs\"\nprovides = [\"fs\"]\nuses = [\"fs\"]\n",
    );
    assert_eq!(kind, ErrorKind::SelfUse);
    assert_eq!(
        msg,
        "sys.toml:8:9: component `ramfs` uses interface `fs`, which it provides itself"
    );
    let (msg, kind) = err_with_head(&format!(
        "{RAMFS}[[component]]\nname = \"other\"\nbinary = \"o\"\nprovides = [\"fs\"]\nuses = [\"fs@other\"]\n"
    ));
    assert_eq!(kind, ErrorKind::SelfUse);
    assert_eq!(
        msg,
        "sys.toml:13:9: component `other` uses interface `fs`, which it provides itself"
    );
}

#[test]
fn dependency_cycle() {
    let (msg, kind) = err_with_head(
        "[[component]]\nname = \"workload\"\nbinary = \"w\"\nprovides = [\"ctl\"]\nuses = [\"fs\"]\n\n\
         [[component]]\nname = \"ramfs\"\nbinary = \"r\"\nprovides = [\"fs\"]\nuses = [\"ctl\"]\n",
    );
    assert_eq!(kind, ErrorKind::Cycle);
    assert_eq!(
        msg,
        "sys.toml:8:9: dependency cycle workload -> ramfs -> workload: the system cannot start"
    );

    // A cycle b -> c -> b behind a that depends on it; reported from b (first in file order).
    let (msg, kind) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\nuses = [\"ib\"]\n\
         [[component]]\nname = \"c\"\nbinary = \"c\"\nprovides = [\"ic\"]\nuses = [\"ib\"]\n\
         [[component]]\nname = \"b\"\nbinary = \"b\"\nprovides = [\"ib\"]\nuses = [\"x\", \"ic\"]\n\
         [[component]]\nname = \"x\"\nbinary = \"x\"\nprovides = [\"x\"]\n",
    );
    assert_eq!(kind, ErrorKind::Cycle);
    assert_eq!(
        msg,
        "sys.toml:12:9: dependency cycle c -> b -> c: the system cannot start"
    );
}

#[test]
fn out_of_range_values() {
    let comp = |extra: &str| format!("[[component]]\nname = \"a\"\nbinary = \"a\"\n{extra}\n");
    let cases = [
        (
            "priority = 20",
            "sys.toml:7:12: component `a`: priority 20 is out of range (a nice value, -20..=19)",
        ),
        (
            "priority = -21",
            "sys.toml:7:12: component `a`: priority -21 is out of range (a nice value, -20..=19)",
        ),
        (
            "slots = 0",
            "sys.toml:7:9: component `a`: slots 0 is out of range (1..=64)",
        ),
        (
            "slots = 65",
            "sys.toml:7:9: component `a`: slots 65 is out of range (1..=64)",
        ),
        (
            "restart = { max = 3, window_ms = 0 }",
            "sys.toml:7:34: component `a`: restart.window_ms 0 is out of range (1..=86400000)",
        ),
        (
            "restart = { backoff_ms = 50, backoff_max_ms = 20 }",
            "sys.toml:7:47: component `a`: restart.backoff_max_ms (20) is below restart.backoff_ms (50)",
        ),
        (
            "restart = { backoff_after = 1001 }",
            "sys.toml:7:29: component `a`: restart.backoff_after 1001 is out of range (0..=1000)",
        ),
        (
            "restart = { max = -1 }",
            "sys.toml:7:19: component `a`: restart.max -1 is out of range (0..=4294967295)",
        ),
        (
            "restart = { max = 4294967296 }",
            "sys.toml:7:19: component `a`: restart.max 4294967296 is out of range (0..=4294967295)",
        ),
        (
            "realtime = 0",
            "sys.toml:7:12: component `a`: realtime 0 is out of range (a SCHED_FIFO priority, 1..=99)",
        ),
        (
            "realtime = 100",
            "sys.toml:7:12: component `a`: realtime 100 is out of range (a SCHED_FIFO priority, 1..=99)",
        ),
        (
            "arena_kib = -1",
            "sys.toml:7:13: component `a`: arena_kib -1 is out of range (0..=1048576)",
        ),
        (
            "arena_kib = 1048577",
            "sys.toml:7:13: component `a`: arena_kib 1048577 is out of range (0..=1048576)",
        ),
        (
            "pool_kib = 2000000",
            "sys.toml:7:12: component `a`: pool_kib 2000000 is out of range (0..=1048576)",
        ),
        (
            "checkpoint = { every_ms = 0 }",
            "sys.toml:7:27: component `a`: checkpoint.every_ms 0 is out of range (1..=3600000)",
        ),
        (
            "checkpoint = { every_ms = 10, keep = 1001 }",
            "sys.toml:7:38: component `a`: checkpoint.keep 1001 is out of range (0..=1000)",
        ),
        (
            "checkpoint = { every_ms = 10, read_ahead_pages = -1 }",
            "sys.toml:7:50: component `a`: checkpoint.read_ahead_pages -1 is out of range (0..=1099511627776)",
        ),
    ];
    for (extra, want) in cases {
        let (msg, kind) = err_with_head(&comp(extra));
        assert_eq!(kind, ErrorKind::OutOfRange, "{extra}");
        assert_eq!(msg, want, "{extra}");
    }
}

#[test]
fn invalid_names() {
    let (msg, kind) = err("[system]\nname = \"\"\n");
    assert_eq!(kind, ErrorKind::InvalidName);
    assert_eq!(msg, "sys.toml:2:8: system name must not be empty");
    let (msg, _) = err_with_head("[[component]]\nname = \"\"\nbinary = \"a\"\n");
    assert_eq!(msg, "sys.toml:5:8: component name must not be empty");
    let (msg, kind) = err_with_head("[[component]]\nname = \"RamFS\"\nbinary = \"a\"\n");
    assert_eq!(kind, ErrorKind::InvalidName);
    assert_eq!(
        msg,
        "sys.toml:5:8: component name `RamFS` contains 'R': names may only contain a-z, 0-9, `_` and `-`"
    );
    let (msg, _) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\nprovides = [\"ok\", \"f s\"]\n",
    );
    assert_eq!(
        msg,
        "sys.toml:7:19: interface name `f s` contains ' ': names may only contain a-z, 0-9, `_` and `-`"
    );
    let (msg, _) = err_with_head(&format!(
        "{RAMFS}[[component]]\nname = \"w\"\nbinary = \"w\"\nuses = [\"fs@\"]\n"
    ));
    assert_eq!(
        msg,
        "sys.toml:12:9: in `fs@`: component name must not be empty"
    );
    let (msg, _) = err_with_head("[[component]]\nname = \"a\"\nbinary = \"\"\n");
    assert_eq!(
        msg,
        "sys.toml:6:10: component `a`: binary must not be empty"
    );
}

#[test]
fn duplicate_interfaces_and_no_components() {
    let (msg, kind) =
        err_with_head("[[component]]\nname = \"a\"\nbinary = \"a\"\nprovides = [\"fs\", \"fs\"]\n");
    assert_eq!(kind, ErrorKind::DuplicateInterface);
    assert_eq!(
        msg,
        "sys.toml:7:19: component `a` provides interface `fs` twice"
    );
    let (msg, kind) = err(HEAD);
    assert_eq!(kind, ErrorKind::NoComponents);
    assert_eq!(
        msg,
        "sys.toml:2:8: system `t` has no components (add a [[component]] table)"
    );
}

#[test]
fn non_finite_config_float() {
    let (msg, kind) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\n[component.config]\nx = { y = nan }\n",
    );
    assert_eq!(kind, ErrorKind::InvalidConfig);
    assert!(msg.starts_with("sys.toml:"), "{msg}");
    assert!(
        msg.ends_with(
            "component `a`: config key `x.y` is not a finite number and cannot be passed as JSON"
        ),
        "{msg}"
    );
}

#[test]
fn watchdog_is_off_without_its_table_and_on_with_it() {
    let s = parse(Path::new("systems/demo.toml"), DEMO).unwrap();
    assert!(!s.watchdog.enabled);
    let text = format!(
        "{HEAD}[watchdog]\nperiod_us = 500\nwindow = 20\nmargin = 3\nstuck_ms = 200\n\n[[component]]\nname = \"a\"\nbinary = \"a\"\n"
    );
    let s = parse(Path::new("sys.toml"), &text).unwrap();
    let w = &s.watchdog;
    assert!(w.enabled);
    assert_eq!(w.period, Duration::from_micros(500));
    assert_eq!((w.window, w.margin), (20, 3.0));
    assert_eq!(w.stuck, Duration::from_millis(200));
    assert_eq!(w.floor, Duration::from_millis(20), "defaults fill the rest");
}

#[test]
fn a_components_watchdog_replaces_the_fields_it_writes() {
    let text = format!(
        "{HEAD}[watchdog]\nstuck_ms = 200\nmargin = 3\n\n\
         [[component]]\nname = \"a\"\nbinary = \"a\"\nwatchdog = {{ stuck_ms = 900 }}\n\
         [[component]]\nname = \"b\"\nbinary = \"b\"\nwatchdog = {{ enabled = false }}\n\
         [[component]]\nname = \"c\"\nbinary = \"c\"\n"
    );
    let s = parse(Path::new("sys.toml"), &text).unwrap();
    let a = s.watchdog_of("a");
    assert!(a.enabled);
    assert_eq!((a.stuck, a.margin), (Duration::from_millis(900), 3.0));
    assert!(!s.watchdog_of("b").enabled);
    assert_eq!(s.watchdog_of("c"), &s.watchdog);
    assert!(s.watched());
    // The system's off: a component's own table watches it alone.
    let text = format!(
        "{HEAD}[[component]]\nname = \"a\"\nbinary = \"a\"\nwatchdog = {{ enabled = true }}\n\
         [[component]]\nname = \"b\"\nbinary = \"b\"\nwatchdog = {{ stuck_ms = 9 }}\n"
    );
    let s = parse(Path::new("sys.toml"), &text).unwrap();
    assert!(s.watchdog_of("a").enabled && !s.watchdog_of("b").enabled);
    let (msg, _) = err_with_head(
        "[[component]]\nname = \"a\"\nbinary = \"a\"\nwatchdog = { period_us = 100 }\n",
    );
    assert_eq!(
        msg,
        "sys.toml:7:26: component `a`: watchdog: period_us is the monitor's, one for the system: set it in [watchdog]"
    );
}

#[test]
fn watchdog_errors_point_at_the_value() {
    let comp = "[[component]]\nname = \"a\"\nbinary = \"a\"\n";
    assert_eq!(
        err_with_head(&format!("[watchdog]\nwindow = 65\n{comp}")),
        (
            "sys.toml:5:10: [watchdog]: window 65 is out of range (1..=64)".to_string(),
            ErrorKind::OutOfRange
        )
    );
    assert_eq!(
        err_with_head(&format!("[watchdog]\nmargin = 0.5\n{comp}")),
        (
            "sys.toml:5:10: [watchdog]: margin must be a number from 1 to 1000, not 0.5"
                .to_string(),
            ErrorKind::OutOfRange
        )
    );
    let (msg, kind) = err_with_head(&format!("[watchdog]\nperiod = 5\n{comp}"));
    assert_eq!(kind, ErrorKind::Syntax);
    assert!(
        msg.starts_with("sys.toml:5:1: unknown field `period`"),
        "{msg}"
    );
}

#[test]
fn spin_policy() {
    let web = parse(
        Path::new("systems/web.toml"),
        include_str!("../../../systems/web.toml"),
    )
    .unwrap();
    assert_eq!(web.spin, SpinPolicy::Adaptive);
    let demo = parse(Path::new("systems/demo.toml"), DEMO).unwrap();
    assert_eq!(demo.spin, SpinPolicy::Always, "the default");
    let spin = |policy: &str| format!("[system]\nname = \"t\"\nspin = \"{policy}\"\n");
    let unless = format!(
        "{}[[component]]\nname = \"a\"\nbinary = \"a\"\n",
        spin("unless-oversubscribed")
    );
    let unless = parse(Path::new("sys.toml"), &unless).unwrap();
    assert_eq!(unless.spin, SpinPolicy::UnlessOversubscribed);
    let (msg, kind) = err(&spin("never"));
    assert_eq!(kind, ErrorKind::Syntax);
    assert_eq!(
        msg,
        "sys.toml:3:8: unknown variant `never`, expected one of `always`, `unless-oversubscribed`, `adaptive`"
    );
}

#[test]
fn a_components_user_is_resolved_by_name_or_uid_or_refused_where_written() {
    let body = |user: &str| format!("[[component]]\nname = \"a\"\nbinary = \"a\"\nuser = {user}\n");
    let s = parse(
        Path::new("sys.toml"),
        &format!("{HEAD}{}", body("\"nobody\"")),
    )
    .unwrap();
    let u = s.component("a").unwrap().user.clone().unwrap();
    assert_eq!((u.name.as_str(), u.uid, u.gid), ("nobody", 65534, 65534));
    // A uid the user database knows takes its group; another, its number.
    let s = parse(Path::new("sys.toml"), &format!("{HEAD}{}", body("1"))).unwrap();
    let u = s.component("a").unwrap().user.clone().unwrap();
    assert_eq!((u.uid, u.gid), (1, 1));
    let s = parse(Path::new("sys.toml"), &format!("{HEAD}{}", body("54321"))).unwrap();
    let u = s.component("a").unwrap().user.clone().unwrap();
    assert_eq!((u.name.as_str(), u.uid, u.gid), ("54321", 54321, 54321));
    let s = parse(Path::new("sys.toml"), DEMO).unwrap();
    assert!(s.components.iter().all(|c| c.user.is_none()), "the default");

    let (msg, kind) = err_with_head(&body("\"no-such-user-here\""));
    assert_eq!(kind, ErrorKind::UnknownUser);
    assert_eq!(
        msg,
        "sys.toml:7:8: component `a`: user `no-such-user-here` does not exist on this machine"
    );
    let (msg, kind) = err_with_head(&body("-1"));
    assert_eq!(kind, ErrorKind::OutOfRange);
    assert_eq!(
        msg,
        "sys.toml:7:8: component `a`: user -1 is no uid (0..=4294967294)"
    );
}

#[test]
fn a_vault_directory_is_relative_to_the_system_file_and_synced_by_default() {
    let comp = "[[component]]\nname = \"a\"\nbinary = \"a\"\n";
    let text = |vault: &str| format!("[system]\nname = \"t\"\nvault = {vault}\n\n{comp}");
    let s = parse(Path::new("etc/sys.toml"), &text("{ dir = \"state\" }")).unwrap();
    let v = s.vault.expect("kept on disk");
    assert_eq!(v.dir, Path::new("etc/state"));
    assert_eq!(v.fsync, kintsugi_system::FsyncPolicy::Always);
    let s = parse(
        Path::new("etc/sys.toml"),
        &text("{ dir = \"/var/k\", fsync = \"never\" }"),
    )
    .unwrap();
    let v = s.vault.unwrap();
    assert_eq!(
        (v.dir.as_path(), v.fsync),
        (Path::new("/var/k"), kintsugi_system::FsyncPolicy::Never)
    );
    assert!(parse(Path::new("sys.toml"), DEMO).unwrap().vault.is_none());
    let (msg, kind) = err(&text("{ dir = \"\" }"));
    assert_eq!(kind, ErrorKind::InvalidConfig);
    assert_eq!(msg, "sys.toml:3:17: vault.dir must name a directory");
    let (msg, _) = err(&text("{ dir = \"s\", fsync = \"sometimes\" }"));
    assert!(msg.starts_with("sys.toml:3:"), "{msg}");
    assert!(msg.contains("always") && msg.contains("never"), "{msg}");
}

#[test]
fn a_components_syscalls_are_known_allowable_once_or_refused_where_written() {
    let body =
        |calls: &str| format!("[[component]]\nname = \"a\"\nbinary = \"a\"\nsyscalls = {calls}\n");
    let s = parse(
        Path::new("sys.toml"),
        &format!("{HEAD}{}", body("[\"socket\", \"connect\"]")),
    )
    .unwrap();
    let a = s.component("a").unwrap();
    assert_eq!(a.syscalls, [Sysno::socket, Sysno::connect]);
    let json = serde_json::to_value(a).unwrap();
    assert_eq!(json["syscalls"], serde_json::json!(["socket", "connect"]));
    let s = parse(Path::new("sys.toml"), DEMO).unwrap();
    assert!(
        s.components.iter().all(|c| c.syscalls.is_empty()),
        "the default"
    );

    let (msg, kind) = err_with_head(&body("[\"socket\", \"sokcet\"]"));
    assert_eq!(kind, ErrorKind::UnknownSyscall);
    assert_eq!(
        msg,
        format!(
            "sys.toml:7:23: component `a`: syscalls: `sokcet` is not a system call of this architecture ({})",
            std::env::consts::ARCH
        )
    );
    let (msg, kind) = err_with_head(&body("[\"ptrace\"]"));
    assert_eq!(kind, ErrorKind::ForbiddenSyscall);
    assert!(
        msg.starts_with(
            "sys.toml:7:13: component `a`: syscalls: `ptrace` reaches beyond the component"
        ),
        "{msg}"
    );
    let (msg, kind) = err_with_head(&body("[\"bind\", \"bind\"]"));
    assert_eq!(kind, ErrorKind::InvalidConfig);
    assert_eq!(
        msg,
        "sys.toml:7:21: component `a`: syscalls: `bind` is listed twice"
    );
}

#[test]
fn a_components_cpus_are_numbers_listed_once_or_refused_where_written() {
    let body = |cpus: &str| format!("[[component]]\nname = \"a\"\nbinary = \"a\"\ncpus = {cpus}\n");
    let s = parse(Path::new("sys.toml"), &format!("{HEAD}{}", body("[1, 0]"))).unwrap();
    let a = s.component("a").unwrap();
    assert_eq!(a.cpus, [1, 0]);
    assert_eq!(
        serde_json::to_value(a).unwrap()["cpus"],
        serde_json::json!([1, 0])
    );
    let s = parse(Path::new("sys.toml"), DEMO).unwrap();
    assert!(
        s.components.iter().all(|c| c.cpus.is_empty()),
        "the default"
    );

    let (msg, kind) = err_with_head(&body("[0, 1024]"));
    assert_eq!(kind, ErrorKind::OutOfRange);
    assert_eq!(
        msg,
        "sys.toml:7:12: component `a`: cpus 1024 is out of range (a CPU number, 0..=1023)"
    );
    let (msg, kind) = err_with_head(&body("[-1]"));
    assert_eq!(kind, ErrorKind::OutOfRange);
    assert!(
        msg.starts_with("sys.toml:7:9: component `a`: cpus -1"),
        "{msg}"
    );
    let (msg, kind) = err_with_head(&body("[1, 1]"));
    assert_eq!(kind, ErrorKind::InvalidConfig);
    assert_eq!(
        msg,
        "sys.toml:7:12: component `a`: cpus: CPU 1 is listed twice"
    );
    let (msg, kind) = err_with_head(&body("[]"));
    assert_eq!(kind, ErrorKind::InvalidConfig);
    assert_eq!(
        msg,
        "sys.toml:7:8: component `a`: cpus = [] leaves it no CPU to run on (leave cpus out for any)"
    );
}

#[test]
fn a_keeper_has_defaults_and_refuses_a_hang_bound_a_loaded_machine_would_trip() {
    let comp = "[[component]]\nname = \"a\"\nbinary = \"a\"\n";
    let text = |keeper: &str| format!("[system]\nname = \"t\"\nkeeper = {keeper}\n\n{comp}");
    assert!(parse(Path::new("sys.toml"), DEMO).unwrap().keeper.is_none());
    let k = parse(Path::new("sys.toml"), &text("{}")).unwrap().keeper;
    assert_eq!(k, Some(kintsugi_system::KeeperPolicy::default()));
    let k = parse(
        Path::new("sys.toml"),
        &text("{ hang_ms = 300, max = 5, window_ms = 2000 }"),
    )
    .unwrap()
    .keeper
    .unwrap();
    assert_eq!(
        (k.hang, k.max, k.window),
        (Duration::from_millis(300), 5, Duration::from_secs(2))
    );
    let (msg, kind) = err(&text("{ hang_ms = 20 }"));
    assert_eq!(kind, ErrorKind::OutOfRange);
    assert_eq!(
        msg,
        "sys.toml:3:22: system: keeper.hang_ms 20 is out of range (100..=86400000)"
    );
    let (msg, _) = err(&text("{ restarts = 3 }"));
    assert!(
        msg.starts_with("sys.toml:3:") && msg.contains("restarts"),
        "{msg}"
    );
}
