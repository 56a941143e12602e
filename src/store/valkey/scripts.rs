//! The Lua scripts, compiled into the binary. Each is the shared prelude (`lua/lib.lua`) followed
//! by one operation, so validation and reply caching are written once.

use std::sync::LazyLock;

use redis::Script;

/// One script: its source and its prepared, hashed form.
pub struct LuaScript {
    /// The full source sent by `SCRIPT LOAD` / `EVAL`.
    pub source: &'static str,
    /// The prepared script, run with EVALSHA.
    pub script: Script,
}

macro_rules! lua {
    ($file:literal) => {{
        let source = concat!(
            include_str!("../../../lua/lib.lua"),
            "\n",
            include_str!(concat!("../../../lua/", $file))
        );
        LuaScript {
            source,
            script: Script::new(source),
        }
    }};
}

/// One compiled script per operation.
pub struct Scripts {
    /// `lua/acquire.lua`
    pub acquire: LuaScript,
    /// `lua/renew.lua`
    pub renew: LuaScript,
    /// `lua/release.lua`
    pub release: LuaScript,
    /// `lua/commit.lua`
    pub commit: LuaScript,
    /// `lua/check.lua`
    pub check: LuaScript,
    /// `lua/read.lua`
    pub read: LuaScript,
    /// `lua/inspect.lua`
    pub inspect: LuaScript,
    /// `lua/repair.lua`
    pub repair: LuaScript,
}

/// The scripts, hashed once per process.
pub static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    acquire: lua!("acquire.lua"),
    renew: lua!("renew.lua"),
    release: lua!("release.lua"),
    commit: lua!("commit.lua"),
    check: lua!("check.lua"),
    read: lua!("read.lua"),
    inspect: lua!("inspect.lua"),
    repair: lua!("repair.lua"),
});

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MAX_FLOOR_LEAD_MICROS, MAX_TOKEN, MAX_TOKEN_LEAD_MICROS};

    /// The bounds the scripts enforce are the ones the memory backend and the controller use.
    #[test]
    fn lua_constants_match_rust() {
        let lib = include_str!("../../../lua/lib.lua");
        for (line, value) in [
            ("local MAX_TOKEN = ", MAX_TOKEN),
            ("local MAX_LEAD = ", MAX_TOKEN_LEAD_MICROS),
            ("local MAX_FLOOR_LEAD = ", MAX_FLOOR_LEAD_MICROS),
        ] {
            let expected = format!("{line}{value}\n");
            assert!(
                lib.contains(&expected),
                "lua/lib.lua lacks `{}`",
                expected.trim()
            );
        }
        assert!(SCRIPTS.acquire.source.contains("next_token("));
    }

    /// docs/operations.md grants the ACL user exactly the commands the scripts run: one
    /// missing fails the calls that reach it, one extra is a right nobody needs.
    #[test]
    fn acl_rule_grants_what_the_scripts_run() {
        let all = [
            &SCRIPTS.acquire,
            &SCRIPTS.renew,
            &SCRIPTS.release,
            &SCRIPTS.commit,
            &SCRIPTS.check,
            &SCRIPTS.read,
            &SCRIPTS.inspect,
            &SCRIPTS.repair,
        ];
        let mut run: Vec<String> = Vec::new();
        for script in all {
            for call in ["redis.call('", "redis.pcall('"] {
                for (at, _) in script.source.match_indices(call) {
                    let rest = &script.source[at + call.len()..];
                    let name = &rest[..rest.find('\'').expect("quoted command")];
                    run.push(format!("+{}", name.to_lowercase()));
                }
            }
        }
        run.sort();
        run.dedup();
        let docs = include_str!("../../../docs/operations.md");
        let row = docs
            .lines()
            .find(|l| l.ends_with("| what the scripts run (`lua/`) |"))
            .expect("the row of script commands in docs/operations.md");
        let mut granted: Vec<String> = row
            .trim_start_matches("| `")
            .split('`')
            .next()
            .expect("commands")
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        granted.sort();
        assert_eq!(granted, run, "docs/operations.md row: {row}");
        let rule = docs
            .lines()
            .find(|l| l.starts_with("ACL SETUSER targetlease on"))
            .expect("the ACL rule");
        for command in &run {
            assert!(
                rule.split_whitespace().any(|w| w == command),
                "the ACL rule lacks {command}"
            );
        }
    }
}
