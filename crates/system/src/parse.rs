//! TOML → validated [`System`].

use std::collections::{BTreeMap, HashMap};
use std::fmt::Display;
use std::ops::{Range, RangeInclusive};
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use crate::{
    Backoff, Capability, CheckpointPolicy, ComponentSpec, ErrorKind, FsyncPolicy, GiveUpAction,
    GroupStrategy, HangAction, KeeperPolicy, Location, RebootMode, RecoveryMode, RestartGroup,
    RestartPolicy, RestartType, SpinPolicy, Sysno, System, SystemError, Use, User, VaultQuota,
    VaultStorage, WatchdogSettings, CHECKPOINT_EVERY_MS_RANGE, CHECKPOINT_KEEP_RANGE,
    CHECKPOINT_READ_AHEAD_RANGE, CPU_RANGE, DEFAULT_JOURNAL_KIB, DEFAULT_READ_AHEAD_PAGES,
    DEFAULT_SLOTS, DURABLE_KIB_RANGE, JOURNAL_KIB_RANGE, MAX_WATCH_WINDOW, PRIORITY_RANGE,
    REALTIME_RANGE, SLOTS_RANGE,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    system: RawSystem,
    #[serde(default)]
    component: Vec<RawComponent>,
    watchdog: Option<RawWatchdog>,
    #[serde(default)]
    group: Vec<RawGroup>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGroup {
    name: Spanned<String>,
    members: Vec<Spanned<String>>,
    strategy: GroupStrategy,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWatchdog {
    enabled: Option<bool>,
    period_us: Option<Spanned<i64>>,
    window: Option<Spanned<i64>>,
    margin: Option<Spanned<toml::Value>>,
    default_bound_us: Option<Spanned<i64>>,
    floor_us: Option<Spanned<i64>>,
    stuck_ms: Option<Spanned<i64>>,
    min_section_us: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSystem {
    name: Spanned<String>,
    #[serde(default)]
    description: String,
    #[serde(default)]
    spin: SpinPolicy,
    vault: Option<RawVaultStorage>,
    keeper: Option<RawKeeper>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKeeper {
    hang_ms: Option<Spanned<i64>>,
    max: Option<Spanned<i64>>,
    window_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVaultStorage {
    dir: Spanned<String>,
    #[serde(default)]
    fsync: FsyncPolicy,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawComponent {
    name: Spanned<String>,
    binary: Spanned<String>,
    #[serde(default)]
    provides: Vec<Spanned<String>>,
    #[serde(default)]
    uses: Vec<Spanned<String>>,
    priority: Option<Spanned<i64>>,
    realtime: Option<Spanned<i64>>,
    cpus: Option<Spanned<Vec<Spanned<i64>>>>,
    recovery: Option<RecoveryMode>,
    reboot: Option<RebootMode>,
    restart: Option<RawRestart>,
    slots: Option<Spanned<i64>>,
    arena_kib: Option<Spanned<i64>>,
    pool_kib: Option<Spanned<i64>>,
    journal_kib: Option<Spanned<i64>>,
    capabilities: Option<Vec<Capability>>,
    syscalls: Option<Vec<Spanned<String>>>,
    user: Option<Spanned<RawUser>>,
    vault_quota: Option<RawVaultQuota>,
    sockets: Option<BTreeMap<String, Spanned<String>>>,
    watchdog: Option<RawWatchdog>,
    start_timeout_ms: Option<Spanned<i64>>,
    stop_timeout_ms: Option<Spanned<i64>>,
    checkpoint: Option<Spanned<RawCheckpoint>>,
    config: Option<Spanned<toml::Table>>,
}

/// `user = "name"` or `user = 1234`.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawUser {
    Name(String),
    Id(i64),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheckpoint {
    every_ms: Spanned<i64>,
    keep: Option<Spanned<i64>>,
    on_hang: Option<HangAction>,
    read_ahead_pages: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRestart {
    max: Option<Spanned<i64>>,
    window_ms: Option<Spanned<i64>>,
    on_give_up: Option<GiveUpAction>,
    #[serde(rename = "type")]
    kind: Option<RestartType>,
    backoff: Option<bool>,
    backoff_after: Option<Spanned<i64>>,
    backoff_ms: Option<Spanned<i64>>,
    backoff_max_ms: Option<Spanned<i64>>,
    healthy_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVaultQuota {
    records: Option<Spanned<i64>>,
    kib: Option<Spanned<i64>>,
    fds: Option<Spanned<i64>>,
}

struct Ctx<'a> {
    path: &'a Path,
    text: &'a str,
}

impl Ctx<'_> {
    fn loc(&self, span: &Range<usize>) -> Location {
        Location::of_offset(self.text, span.start)
    }

    fn err(&self, span: &Range<usize>, kind: ErrorKind, message: impl Into<String>) -> SystemError {
        SystemError::Invalid {
            path: self.path.to_path_buf(),
            location: Some(self.loc(span)),
            kind,
            message: message.into(),
        }
    }

    fn check_name(&self, what: &str, name: &Spanned<String>) -> Result<(), SystemError> {
        let n = name.get_ref();
        if n.is_empty() {
            return Err(self.err(
                &name.span(),
                ErrorKind::InvalidName,
                format!("{what} name must not be empty"),
            ));
        }
        if let Some(bad) = n
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_' || *c == '-'))
        {
            return Err(self.err(
                &name.span(),
                ErrorKind::InvalidName,
                format!(
                    "{what} name `{n}` contains {bad:?}: names may only contain a-z, 0-9, `_` and `-`"
                ),
            ));
        }
        Ok(())
    }

    /// `owner`'s optional number `field` (`owner` is ``component `x` `` or a
    /// table such as `[watchdog]`), checked to lie in `range` (`hint`
    /// introduces the range in the error).
    fn ranged<T>(
        &self,
        owner: &str,
        field: &str,
        value: &Option<Spanned<i64>>,
        range: RangeInclusive<T>,
        hint: &str,
    ) -> Result<Option<T>, SystemError>
    where
        T: TryFrom<i64> + PartialOrd + Display,
    {
        let Some(value) = value else { return Ok(None) };
        let v = *value.get_ref();
        match T::try_from(v) {
            Ok(t) if range.contains(&t) => Ok(Some(t)),
            _ => Err(self.err(
                &value.span(),
                ErrorKind::OutOfRange,
                format!(
                    "{owner}: {field} {v} is out of range ({hint}{}..={})",
                    range.start(),
                    range.end()
                ),
            )),
        }
    }

    /// Validates the `name` part of an `iface@comp` string (no span of its own).
    fn check_part(
        &self,
        what: &str,
        part: &str,
        whole: &Spanned<String>,
    ) -> Result<(), SystemError> {
        let spanned = Spanned::new(whole.span(), part.to_owned());
        self.check_name(what, &spanned).map_err(|e| match e {
            SystemError::Invalid {
                path,
                location,
                kind,
                message,
            } => SystemError::Invalid {
                path,
                location,
                kind,
                message: format!("in `{}`: {message}", whole.get_ref()),
            },
            other => other,
        })
    }
}

/// A component while being validated.
struct Pending {
    spec: ComponentSpec,
    name_span: Range<usize>,
    binary_span: Range<usize>,
    /// (interface, explicit server, span) of each `uses` entry.
    uses: Vec<(String, Option<String>, Range<usize>)>,
}

pub(crate) fn parse(path: &Path, text: &str) -> Result<System, SystemError> {
    let cx = Ctx { path, text };
    let raw: RawFile = toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        let message = e
            .message()
            .trim_end()
            .replace("expected i64", "expected an integer")
            .replace('\n', ": ");
        cx.err(&span, ErrorKind::Syntax, message)
    })?;

    cx.check_name("system", &raw.system.name)?;
    if raw.component.is_empty() {
        return Err(cx.err(
            &raw.system.name.span(),
            ErrorKind::NoComponents,
            format!(
                "system `{}` has no components (add a [[component]] table)",
                raw.system.name.get_ref()
            ),
        ));
    }

    let watchdog = match &raw.watchdog {
        Some(w) => watchdog(&cx, w, &WatchdogSettings::default(), None)?,
        None => WatchdogSettings::default(),
    };

    let mut pending: Vec<Pending> = Vec::with_capacity(raw.component.len());
    let mut by_name: HashMap<String, usize> = HashMap::new();
    for (i, rc) in raw.component.into_iter().enumerate() {
        let p = component(&cx, i, rc, &watchdog)?;
        if by_name.contains_key(&p.spec.name) {
            return Err(cx.err(
                &p.name_span,
                ErrorKind::DuplicateName,
                format!("duplicate component name `{}`", p.spec.name),
            ));
        }
        by_name.insert(p.spec.name.clone(), i);
        pending.push(p);
    }

    // Providers of each interface, in file order.
    let mut providers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, p) in pending.iter().enumerate() {
        for iface in &p.spec.provides {
            providers.entry(iface.as_str()).or_default().push(i);
        }
    }

    // Resolve every `uses` entry to its server.
    let mut deps: Vec<Vec<(usize, Range<usize>)>> = Vec::with_capacity(pending.len());
    let mut resolved_uses: Vec<Vec<Use>> = Vec::with_capacity(pending.len());
    for (i, p) in pending.iter().enumerate() {
        let me = &p.spec.name;
        let mut d = Vec::new();
        let mut uses: Vec<Use> = Vec::new();
        for (iface, server, span) in &p.uses {
            let server_idx = match server {
                Some(s) => {
                    let Some(&j) = by_name.get(s) else {
                        return Err(cx.err(
                            span,
                            ErrorKind::UnknownComponent,
                            format!(
                                "component `{me}` uses `{iface}@{s}`, but there is no component `{s}`"
                            ),
                        ));
                    };
                    if j == i {
                        return Err(self_use(&cx, span, me, iface));
                    }
                    if !pending[j].spec.provides.iter().any(|x| x == iface) {
                        return Err(cx.err(
                            span,
                            ErrorKind::NotProvided,
                            format!(
                                "component `{me}` uses interface `{iface}` from `{s}`, which does not provide it"
                            ),
                        ));
                    }
                    j
                }
                None => match providers.get(iface.as_str()).map(Vec::as_slice) {
                    None | Some([]) => {
                        return Err(cx.err(
                            span,
                            ErrorKind::UnknownInterface,
                            format!(
                                "component `{me}` uses interface `{iface}`, which no component provides"
                            ),
                        ))
                    }
                    Some([j]) => {
                        if *j == i {
                            return Err(self_use(&cx, span, me, iface));
                        }
                        *j
                    }
                    Some(many) => {
                        let names: Vec<&str> =
                            many.iter().map(|&j| pending[j].spec.name.as_str()).collect();
                        let choices: Vec<String> =
                            names.iter().map(|n| format!("`{iface}@{n}`")).collect();
                        return Err(cx.err(
                            span,
                            ErrorKind::AmbiguousProvider,
                            format!(
                                "component `{me}` uses interface `{iface}`, which is provided by {}: write {}",
                                quote_list(&names, "and"),
                                join_list(&choices, "or"),
                            ),
                        ));
                    }
                },
            };
            let u = Use {
                interface: iface.clone(),
                server: pending[server_idx].spec.name.clone(),
            };
            if uses.contains(&u) {
                return Err(cx.err(
                    span,
                    ErrorKind::DuplicateInterface,
                    format!(
                        "component `{me}` uses interface `{iface}` of `{}` twice",
                        u.server
                    ),
                ));
            }
            uses.push(u);
            d.push((server_idx, span.clone()));
        }
        deps.push(d);
        resolved_uses.push(uses);
    }

    let order = start_order(&cx, &pending, &deps)?;

    let mut binary_locations = BTreeMap::new();
    let mut slots: Vec<Option<Pending>> = pending.into_iter().map(Some).collect();
    let mut resolved_uses: Vec<Option<Vec<Use>>> = resolved_uses.into_iter().map(Some).collect();
    let mut components = Vec::with_capacity(order.len());
    for i in order {
        let p = slots[i].take().expect("each component placed once");
        let mut spec = p.spec;
        spec.uses = resolved_uses[i].take().expect("each component placed once");
        binary_locations.insert(spec.name.clone(), cx.loc(&p.binary_span));
        components.push(spec);
    }

    let groups = groups(&cx, &raw.group, &components)?;

    let vault = match &raw.system.vault {
        Some(v) => Some(vault_storage(&cx, v)?),
        None => None,
    };
    let keeper = match &raw.system.keeper {
        Some(k) => Some(keeper_policy(&cx, k)?),
        None => None,
    };

    Ok(System {
        watchdog,
        groups,
        spin: raw.system.spin,
        vault,
        keeper,
        name: raw.system.name.into_inner(),
        description: raw.system.description,
        path: path.to_path_buf(),
        components,
        binary_locations,
    })
}

/// The `[[group]]` tables: named once each, of at least two existing
/// components, none in two groups.
fn groups(
    cx: &Ctx<'_>,
    raw: &[RawGroup],
    components: &[ComponentSpec],
) -> Result<Vec<RestartGroup>, SystemError> {
    let mut out: Vec<RestartGroup> = Vec::new();
    for g in raw {
        cx.check_name("group", &g.name)?;
        let name = g.name.get_ref();
        if out.iter().any(|o| &o.name == name) {
            return Err(cx.err(
                &g.name.span(),
                ErrorKind::DuplicateName,
                format!("duplicate group name `{name}`"),
            ));
        }
        let mut members: Vec<String> = Vec::new();
        for m in &g.members {
            let member = m.get_ref();
            if !components.iter().any(|c| &c.name == member) {
                return Err(cx.err(
                    &m.span(),
                    ErrorKind::UnknownComponent,
                    format!("group `{name}` names `{member}`, which is not a component"),
                ));
            }
            if members.contains(member) || out.iter().any(|o| o.members.contains(member)) {
                return Err(cx.err(
                    &m.span(),
                    ErrorKind::DuplicateName,
                    format!("component `{member}` is in more than one group, or twice in `{name}`"),
                ));
            }
            members.push(member.clone());
        }
        if members.len() < 2 {
            return Err(cx.err(
                &g.name.span(),
                ErrorKind::InvalidConfig,
                format!("group `{name}` needs at least two members"),
            ));
        }
        out.push(RestartGroup {
            name: name.clone(),
            members,
            strategy: g.strategy,
        });
    }
    Ok(out)
}

fn self_use(cx: &Ctx<'_>, span: &Range<usize>, me: &str, iface: &str) -> SystemError {
    cx.err(
        span,
        ErrorKind::SelfUse,
        format!("component `{me}` uses interface `{iface}`, which it provides itself"),
    )
}

fn quote_list(names: &[&str], conj: &str) -> String {
    let q: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    join_list(&q, conj)
}

fn join_list(items: &[String], conj: &str) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} {conj} {last}", init.join(", ")),
    }
}

/// A component's `sockets = { KEY = "NAME", … }`: each NAME as systemd
/// allows a `FileDescriptorName=` (1 to 255 printable ASCII characters, no
/// `:`), each KEY a non-empty vault key.
/// `cpus = [...]`: CPU numbers in [`CPU_RANGE`], each once, at least one.
fn cpus(
    cx: &Ctx<'_>,
    owner: &str,
    raw: Option<&Spanned<Vec<Spanned<i64>>>>,
) -> Result<Vec<u16>, SystemError> {
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    if raw.get_ref().is_empty() {
        return Err(cx.err(
            &raw.span(),
            ErrorKind::InvalidConfig,
            format!("{owner}: cpus = [] leaves it no CPU to run on (leave cpus out for any)"),
        ));
    }
    let mut out = Vec::with_capacity(raw.get_ref().len());
    for cpu in raw.get_ref() {
        let n = cx
            .ranged(
                owner,
                "cpus",
                &Some(cpu.clone()),
                CPU_RANGE,
                "a CPU number, ",
            )?
            .expect("a value was given");
        if out.contains(&n) {
            return Err(cx.err(
                &cpu.span(),
                ErrorKind::InvalidConfig,
                format!("{owner}: cpus: CPU {n} is listed twice"),
            ));
        }
        out.push(n);
    }
    Ok(out)
}

/// `syscalls = [...]`: system calls known on this architecture, none of
/// [`crate::NEVER_ALLOWED`], each once.
fn syscalls(
    cx: &Ctx<'_>,
    owner: &str,
    raw: Option<&[Spanned<String>]>,
) -> Result<Vec<Sysno>, SystemError> {
    let mut out: Vec<Sysno> = Vec::new();
    for name in raw.into_iter().flatten() {
        let n = name.get_ref();
        let refuse = |kind, why: String| {
            Err(cx.err(&name.span(), kind, format!("{owner}: syscalls: {why}")))
        };
        let Ok(call) = n.parse::<Sysno>() else {
            return refuse(
                ErrorKind::UnknownSyscall,
                format!(
                    "`{n}` is not a system call of this architecture ({})",
                    std::env::consts::ARCH
                ),
            );
        };
        if crate::NEVER_ALLOWED.contains(&call) {
            return refuse(
                ErrorKind::ForbiddenSyscall,
                format!("`{n}` reaches beyond the component (other processes, mounts, namespaces, the kernel or the machine): no component may make it"),
            );
        }
        if out.contains(&call) {
            return refuse(ErrorKind::InvalidConfig, format!("`{n}` is listed twice"));
        }
        out.push(call);
    }
    Ok(out)
}

fn sockets(
    cx: &Ctx<'_>,
    owner: &str,
    raw: Option<&BTreeMap<String, Spanned<String>>>,
) -> Result<BTreeMap<String, String>, SystemError> {
    let mut out = BTreeMap::new();
    for (key, name) in raw.into_iter().flatten() {
        let n = name.get_ref();
        let valid = (1..=255).contains(&n.len())
            && n.bytes().all(|b| b.is_ascii_graphic() && b != b':')
            && !key.is_empty();
        if !valid {
            return Err(cx.err(
                &name.span(),
                ErrorKind::InvalidConfig,
                format!("{owner}: sockets.{key} = {n:?}: a socket's name is 1 to 255 printable ASCII characters without `:` (systemd's FileDescriptorName=), under a non-empty vault key"),
            ));
        }
        out.insert(key.clone(), n.clone());
    }
    Ok(out)
}

/// `[system] vault = { dir, fsync }`: a directory relative to the system
/// file's, or absolute.
fn vault_storage(cx: &Ctx<'_>, raw: &RawVaultStorage) -> Result<VaultStorage, SystemError> {
    let dir = raw.dir.get_ref();
    if dir.is_empty() || dir.contains('\0') {
        return Err(cx.err(
            &raw.dir.span(),
            ErrorKind::InvalidConfig,
            "vault.dir must name a directory",
        ));
    }
    let dir = Path::new(dir);
    let dir = match cx.path.parent() {
        Some(base) if dir.is_relative() && !base.as_os_str().is_empty() => base.join(dir),
        _ => dir.to_path_buf(),
    };
    Ok(VaultStorage {
        dir,
        fsync: raw.fsync,
    })
}

/// `[system] keeper = { hang_ms, max, window_ms }`.
fn keeper_policy(cx: &Ctx<'_>, raw: &RawKeeper) -> Result<KeeperPolicy, SystemError> {
    let d = KeeperPolicy::default();
    let ms = |field: &str, v: &Option<Spanned<i64>>, least: u64| {
        cx.ranged("system", field, v, least..=86_400_000u64, "")
            .map(|v| v.map(Duration::from_millis))
    };
    Ok(KeeperPolicy {
        // Under 100 ms a loaded machine would be taken for a hang.
        hang: ms("keeper.hang_ms", &raw.hang_ms, 100)?.unwrap_or(d.hang),
        max: cx
            .ranged("system", "keeper.max", &raw.max, 0..=u32::MAX, "")?
            .unwrap_or(d.max),
        window: ms("keeper.window_ms", &raw.window_ms, 1)?.unwrap_or(d.window),
    })
}

/// A component's `vault_quota = { … }` table.
fn vault_quota(cx: &Ctx<'_>, owner: &str, q: &RawVaultQuota) -> Result<VaultQuota, SystemError> {
    let d = VaultQuota::default();
    let max = 1u64 << 40;
    Ok(VaultQuota {
        records: cx
            .ranged(owner, "vault_quota.records", &q.records, 0..=max, "")?
            .unwrap_or(d.records),
        bytes: cx
            .ranged(owner, "vault_quota.kib", &q.kib, 0..=max >> 10, "")?
            .map_or(d.bytes, |kib: u64| kib << 10),
        fds: cx
            .ranged(owner, "vault_quota.fds", &q.fds, 0..=1_000_000, "")?
            .unwrap_or(d.fds),
    })
}

/// A component's `restart = { … }` table.
fn restart_policy(cx: &Ctx<'_>, owner: &str, r: &RawRestart) -> Result<RestartPolicy, SystemError> {
    let mut restart = RestartPolicy::default();
    let ms = |field: &str, v: &Option<Spanned<i64>>| {
        cx.ranged(owner, field, v, 1..=86_400_000u64, "")
            .map(|v| v.map(Duration::from_millis))
    };
    if let Some(max) = cx.ranged(owner, "restart.max", &r.max, 0..=u32::MAX, "")? {
        restart.max = max;
    }
    if let Some(w) = ms("restart.window_ms", &r.window_ms)? {
        restart.window = w;
    }
    restart.on_give_up = r.on_give_up.unwrap_or_default();
    restart.kind = r.kind.unwrap_or_default();
    let mut b = Backoff::default();
    if let Some(after) = cx.ranged(
        owner,
        "restart.backoff_after",
        &r.backoff_after,
        0..=1000,
        "",
    )? {
        b.after = after;
    }
    b.first = ms("restart.backoff_ms", &r.backoff_ms)?.unwrap_or(b.first);
    b.max = ms("restart.backoff_max_ms", &r.backoff_max_ms)?.unwrap_or(b.max);
    b.healthy = ms("restart.healthy_ms", &r.healthy_ms)?.unwrap_or(b.healthy);
    if r.backoff_max_ms.is_none() {
        b.max = b.max.max(b.first);
    }
    if b.max < b.first {
        let span = r
            .backoff_max_ms
            .as_ref()
            .expect("only a set max can be below the first")
            .span();
        return Err(cx.err(
            &span,
            ErrorKind::OutOfRange,
            format!(
                "{owner}: restart.backoff_max_ms ({}) is below restart.backoff_ms ({})",
                b.max.as_millis(),
                b.first.as_millis()
            ),
        ));
    }
    restart.backoff = r.backoff.unwrap_or(true).then_some(b);
    Ok(restart)
}

/// Validates one `[[component]]` table (everything that does not need the others).
fn component(
    cx: &Ctx<'_>,
    index: usize,
    rc: RawComponent,
    system_watchdog: &WatchdogSettings,
) -> Result<Pending, SystemError> {
    cx.check_name("component", &rc.name)?;
    let name = rc.name.get_ref().clone();

    if rc.binary.get_ref().is_empty() {
        return Err(cx.err(
            &rc.binary.span(),
            ErrorKind::InvalidName,
            format!("component `{name}`: binary must not be empty"),
        ));
    }

    let mut provides: Vec<String> = Vec::with_capacity(rc.provides.len());
    for iface in &rc.provides {
        cx.check_name("interface", iface)?;
        if provides.contains(iface.get_ref()) {
            return Err(cx.err(
                &iface.span(),
                ErrorKind::DuplicateInterface,
                format!(
                    "component `{name}` provides interface `{}` twice",
                    iface.get_ref()
                ),
            ));
        }
        provides.push(iface.get_ref().clone());
    }

    let mut uses = Vec::with_capacity(rc.uses.len());
    for u in &rc.uses {
        let (iface, server) = match u.get_ref().split_once('@') {
            Some((i, s)) => (i, Some(s)),
            None => (u.get_ref().as_str(), None),
        };
        cx.check_part("interface", iface, u)?;
        if let Some(s) = server {
            cx.check_part("component", s, u)?;
        }
        uses.push((iface.to_owned(), server.map(str::to_owned), u.span()));
    }

    let owner = format!("component `{name}`");
    let priority = cx
        .ranged(
            &owner,
            "priority",
            &rc.priority,
            PRIORITY_RANGE,
            "a nice value, ",
        )?
        .unwrap_or(0);
    let realtime = cx.ranged(
        &owner,
        "realtime",
        &rc.realtime,
        REALTIME_RANGE,
        "a SCHED_FIFO priority, ",
    )?;
    let slots = cx
        .ranged(&owner, "slots", &rc.slots, SLOTS_RANGE, "")?
        .unwrap_or(DEFAULT_SLOTS);
    let arena_kib = cx
        .ranged(&owner, "arena_kib", &rc.arena_kib, DURABLE_KIB_RANGE, "")?
        .unwrap_or(0);
    let pool_kib = cx
        .ranged(&owner, "pool_kib", &rc.pool_kib, DURABLE_KIB_RANGE, "")?
        .unwrap_or(0);
    let restart = match &rc.restart {
        Some(r) => restart_policy(cx, &owner, r)?,
        None => RestartPolicy::default(),
    };

    let recovery = rc.recovery.unwrap_or_default();
    let checkpoint = match &rc.checkpoint {
        None => None,
        Some(c) => {
            let c = c.get_ref();
            let every = cx
                .ranged(
                    &owner,
                    "checkpoint.every_ms",
                    &Some(c.every_ms.clone()),
                    CHECKPOINT_EVERY_MS_RANGE,
                    "",
                )?
                .unwrap_or(100);
            let keep = cx
                .ranged(
                    &owner,
                    "checkpoint.keep",
                    &c.keep,
                    CHECKPOINT_KEEP_RANGE,
                    "",
                )?
                .unwrap_or(0);
            let read_ahead_pages = cx
                .ranged(
                    &owner,
                    "checkpoint.read_ahead_pages",
                    &c.read_ahead_pages,
                    CHECKPOINT_READ_AHEAD_RANGE,
                    "",
                )?
                .unwrap_or(DEFAULT_READ_AHEAD_PAGES);
            Some(CheckpointPolicy {
                every: Duration::from_millis(every),
                keep,
                on_hang: c.on_hang.unwrap_or(match recovery {
                    RecoveryMode::Checkpoint => HangAction::Rollback,
                    _ => HangAction::Reboot,
                }),
                read_ahead_pages,
            })
        }
    };
    let checkpoint = match (checkpoint, recovery) {
        (None, RecoveryMode::Checkpoint) => Some(CheckpointPolicy::every(
            Duration::from_millis(100),
            HangAction::Rollback,
        )),
        (c, _) => c,
    };
    let journal_kib = cx.ranged(
        &owner,
        "journal_kib",
        &rc.journal_kib,
        JOURNAL_KIB_RANGE,
        "",
    )?;
    let journal_kib = match (journal_kib, recovery) {
        (Some(kib), RecoveryMode::Checkpoint) => kib,
        (None, RecoveryMode::Checkpoint) => DEFAULT_JOURNAL_KIB,
        (None, _) => 0,
        (Some(_), _) => {
            let span = rc
                .journal_kib
                .as_ref()
                .map(|j| j.span())
                .unwrap_or_default();
            return Err(cx.err(
                &span,
                ErrorKind::InvalidConfig,
                format!("component `{name}`: journal_kib needs recovery = \"checkpoint\" (only a checkpoint-recovered server keeps a request log)"),
            ));
        }
    };

    let config = match &rc.config {
        None => serde_json::Value::Object(serde_json::Map::new()),
        Some(t) => {
            let mut key = String::new();
            table_to_json(t.get_ref(), &mut key).map_err(|bad_key| {
                cx.err(
                    &t.span(),
                    ErrorKind::InvalidConfig,
                    format!(
                        "component `{name}`: config key `{bad_key}` is not a finite number and cannot be passed as JSON"
                    ),
                )
            })?
        }
    };

    Ok(Pending {
        spec: ComponentSpec {
            id: index as u32 + 1,
            name,
            binary: rc.binary.get_ref().into(),
            provides,
            uses: Vec::new(),
            priority,
            realtime,
            cpus: cpus(cx, &owner, rc.cpus.as_ref())?,
            recovery,
            reboot: rc.reboot.unwrap_or_default(),
            restart,
            slots,
            arena_kib,
            pool_kib,
            checkpoint,
            journal_kib,
            start_timeout: cx
                .ranged(
                    &owner,
                    "start_timeout_ms",
                    &rc.start_timeout_ms,
                    1..=3_600_000u64,
                    "",
                )?
                .map(Duration::from_millis),
            stop_timeout: cx
                .ranged(
                    &owner,
                    "stop_timeout_ms",
                    &rc.stop_timeout_ms,
                    0..=3_600_000u64,
                    "",
                )?
                .map(Duration::from_millis),
            user: rc.user.as_ref().map(|u| user(cx, &owner, u)).transpose()?,
            vault_quota: match &rc.vault_quota {
                Some(q) => vault_quota(cx, &owner, q)?,
                None => VaultQuota::default(),
            },
            capabilities: rc
                .capabilities
                .clone()
                .unwrap_or_else(|| Capability::DEFAULT.to_vec()),
            syscalls: syscalls(cx, &owner, rc.syscalls.as_deref())?,
            sockets: sockets(cx, &owner, rc.sockets.as_ref())?,
            watchdog: rc
                .watchdog
                .as_ref()
                .map(|w| watchdog(cx, w, system_watchdog, Some(&owner)))
                .transpose()?,
            config,
        },
        name_span: rc.name.span(),
        binary_span: rc.binary.span(),
        uses,
    })
}

/// Resolves a component's `user` in this machine's user database.
fn user(cx: &Ctx<'_>, owner: &str, raw: &Spanned<RawUser>) -> Result<User, SystemError> {
    let unknown = |what: String| cx.err(&raw.span(), ErrorKind::UnknownUser, what);
    match raw.get_ref() {
        RawUser::Name(name) => match nix::unistd::User::from_name(name) {
            Ok(Some(u)) => Ok(User {
                name: name.clone(),
                uid: u.uid.as_raw(),
                gid: u.gid.as_raw(),
            }),
            Ok(None) => Err(unknown(format!(
                "{owner}: user `{name}` does not exist on this machine"
            ))),
            Err(e) => Err(unknown(format!("{owner}: user `{name}`: {e}"))),
        },
        RawUser::Id(id) => {
            let uid = u32::try_from(*id)
                .ok()
                .filter(|&u| u != u32::MAX)
                .ok_or_else(|| {
                    cx.err(
                        &raw.span(),
                        ErrorKind::OutOfRange,
                        format!("{owner}: user {id} is no uid (0..=4294967294)"),
                    )
                })?;
            let known = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
                .ok()
                .flatten();
            Ok(User {
                name: id.to_string(),
                uid,
                gid: known.map_or(uid, |u| u.gid.as_raw()),
            })
        }
    }
}

/// Validates the `[watchdog]` table (`component` None), whose absent
/// fields take the defaults, or a component's `watchdog = { … }`, whose
/// absent fields take the system's (`base`) and which may not set the
/// monitor's sampling period.
fn watchdog(
    cx: &Ctx<'_>,
    w: &RawWatchdog,
    base: &WatchdogSettings,
    component: Option<&str>,
) -> Result<WatchdogSettings, SystemError> {
    let d = base;
    let owned;
    let n = match component {
        None => "[watchdog]",
        Some(owner) => {
            owned = format!("{owner}: watchdog");
            if let Some(p) = &w.period_us {
                return Err(cx.err(
                    &p.span(),
                    ErrorKind::InvalidConfig,
                    format!("{owned}: period_us is the monitor's, one for the system: set it in [watchdog]"),
                ));
            }
            owned.as_str()
        }
    };
    let us =
        |field: &str, v: &Option<Spanned<i64>>, range: RangeInclusive<u64>, default: Duration| {
            cx.ranged(n, field, v, range, "")
                .map(|v| v.map_or(default, Duration::from_micros))
        };
    let margin = match &w.margin {
        None => d.margin,
        Some(m) => {
            let v = match m.get_ref() {
                toml::Value::Float(f) => *f,
                toml::Value::Integer(i) => *i as f64,
                _ => f64::NAN,
            };
            if !(1.0..=1000.0).contains(&v) {
                return Err(cx.err(
                    &m.span(),
                    ErrorKind::OutOfRange,
                    format!(
                        "{n}: margin must be a number from 1 to 1000, not {}",
                        m.get_ref()
                    ),
                ));
            }
            v
        }
    };
    Ok(WatchdogSettings {
        // The table turns the watchdog on; a component's inherits.
        enabled: w.enabled.unwrap_or(component.is_none() || base.enabled),
        period: us("period_us", &w.period_us, 100..=1_000_000, d.period)?,
        window: cx
            .ranged(n, "window", &w.window, 1..=MAX_WATCH_WINDOW, "")?
            .unwrap_or(d.window),
        margin,
        default_bound: us(
            "default_bound_us",
            &w.default_bound_us,
            1..=600_000_000,
            d.default_bound,
        )?,
        floor: us("floor_us", &w.floor_us, 0..=600_000_000, d.floor)?,
        stuck: cx
            .ranged(n, "stuck_ms", &w.stuck_ms, 1..=3_600_000u64, "")?
            .map_or(d.stuck, Duration::from_millis),
        min_section: us(
            "min_section_us",
            &w.min_section_us,
            0..=600_000_000,
            d.min_section,
        )?,
    })
}

/// TOML → JSON; datetimes become strings. Errs with the dotted key of a non-finite float.
fn table_to_json(t: &toml::Table, key: &mut String) -> Result<serde_json::Value, String> {
    let mut map = serde_json::Map::new();
    for (k, v) in t {
        let len = key.len();
        if !key.is_empty() {
            key.push('.');
        }
        key.push_str(k);
        map.insert(k.clone(), value_to_json(v, key)?);
        key.truncate(len);
    }
    Ok(serde_json::Value::Object(map))
}

fn value_to_json(v: &toml::Value, key: &mut String) -> Result<serde_json::Value, String> {
    use serde_json::Value as J;
    Ok(match v {
        toml::Value::String(s) => J::String(s.clone()),
        toml::Value::Integer(i) => J::from(*i),
        toml::Value::Float(f) => match serde_json::Number::from_f64(*f) {
            Some(n) => J::Number(n),
            None => return Err(key.clone()),
        },
        toml::Value::Boolean(b) => J::Bool(*b),
        toml::Value::Datetime(d) => J::String(d.to_string()),
        toml::Value::Array(a) => {
            let mut out = Vec::with_capacity(a.len());
            for (i, x) in a.iter().enumerate() {
                let len = key.len();
                key.push_str(&format!("[{i}]"));
                out.push(value_to_json(x, key)?);
                key.truncate(len);
            }
            J::Array(out)
        }
        toml::Value::Table(t) => table_to_json(t, key)?,
    })
}

/// Start order: repeatedly the first component in file order whose servers
/// are all started. On a cycle, reports it at the `uses` entry that closes it.
fn start_order(
    cx: &Ctx<'_>,
    pending: &[Pending],
    deps: &[Vec<(usize, Range<usize>)>],
) -> Result<Vec<usize>, SystemError> {
    let n = pending.len();
    let mut placed = vec![false; n];
    let mut order = Vec::with_capacity(n);
    while order.len() < n {
        let next = (0..n).find(|&i| !placed[i] && deps[i].iter().all(|(j, _)| placed[*j]));
        match next {
            Some(i) => {
                placed[i] = true;
                order.push(i);
            }
            None => return Err(cycle_error(cx, pending, deps, &placed)),
        }
    }
    Ok(order)
}

fn cycle_error(
    cx: &Ctx<'_>,
    pending: &[Pending],
    deps: &[Vec<(usize, Range<usize>)>],
    placed: &[bool],
) -> SystemError {
    // Every unplaced component has an unplaced server: walk until a repeat.
    let start = (0..placed.len())
        .find(|&i| !placed[i])
        .expect("some unplaced");
    let mut path = vec![start];
    let mut seen_at = vec![usize::MAX; placed.len()];
    seen_at[start] = 0;
    let cycle: Vec<usize> = loop {
        let cur = *path.last().expect("non-empty");
        let (next, _) = deps[cur]
            .iter()
            .find(|(j, _)| !placed[*j])
            .expect("an unplaced component has an unplaced server");
        if seen_at[*next] != usize::MAX {
            break path[seen_at[*next]..].to_vec();
        }
        seen_at[*next] = path.len();
        path.push(*next);
    };
    // Rotate so that the cycle starts at its first component in file order.
    let k = (0..cycle.len())
        .min_by_key(|&k| cycle[k])
        .expect("non-empty cycle");
    let rotated: Vec<usize> = cycle[k..].iter().chain(&cycle[..k]).copied().collect();
    let first = rotated[0];
    let second = rotated.get(1).copied().unwrap_or(first);
    let span = deps[first]
        .iter()
        .find(|(j, _)| *j == second)
        .map(|(_, s)| s.clone())
        .unwrap_or_else(|| pending[first].name_span.clone());
    let mut names: Vec<&str> = rotated
        .iter()
        .map(|&i| pending[i].spec.name.as_str())
        .collect();
    names.push(&pending[first].spec.name);
    cx.err(
        &span,
        ErrorKind::Cycle,
        format!(
            "dependency cycle {}: the system cannot start",
            names.join(" -> ")
        ),
    )
}
