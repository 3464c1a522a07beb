//! The engine's `proxy` security mode (the dev profile's default): it trusts identity headers set
//! by an authenticating proxy in front of it, exactly as the real engine 0.11 does
//! (docs/REAL_ENGINE.md): `X-Auth-Request-User` (or `X-Auth-Request-Email`) names the caller,
//! missing both is 401 "Trusted proxy identity headers are missing"; the worker endpoints then
//! need the group `abada-worker` in `X-Auth-Request-Groups` (also `/abada-worker`,
//! `abada_worker`, any case; or `abada-admin`) or the permission `worker:execute` in
//! `X-Auth-Request-Permissions` (comma lists), else 403 `ACCESS_DENIED`. A user alone is 403.
//! The process API's reads (`GET /v1/processes/**`) need the permission `process:read` or one of
//! the groups `abada-task-user`, `abada-process-controller`, `abada-operator`, `abada-deployer`,
//! `abada-admin` (the engine's `SecurityConfig`): `abada-worker` alone does not grant them.
//! Likewise the activity history (`GET /v1/process-instances/**`) needs `operations:read` or
//! `abada-operator` / `abada-admin`, and the user-task API `task:read` / `task:write` or
//! `abada-task-user` / `abada-admin`; the caller there, and the `actor` the history records, is
//! the proxy's user (the engine's `IdentityContextInterceptor`).

use super::{AuthRejection, Authorizer, HeaderMap};

/// [`Authorizer`] of the engine's `proxy` security mode.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProxyAuthorizer;

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

fn list<'a>(headers: &'a HeaderMap, name: &str) -> impl Iterator<Item = &'a str> {
    header(headers, name)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

impl ProxyAuthorizer {
    /// The caller has one of `groups` or the permission `permission`; 401 without an identity.
    fn allows(headers: &HeaderMap, groups: &[&str], permission: &str) -> Result<(), AuthRejection> {
        if header(headers, "x-auth-request-user").is_none()
            && header(headers, "x-auth-request-email").is_none()
        {
            return Err(AuthRejection::Unauthenticated(
                "Trusted proxy identity headers are missing".into(),
            ));
        }
        let group = list(headers, "x-auth-request-groups").any(|g| {
            let g = g
                .trim_start_matches('/')
                .to_ascii_lowercase()
                .replace('_', "-");
            groups.contains(&g.as_str())
        });
        let permission = list(headers, "x-auth-request-permissions")
            .any(|p| p.strip_prefix("SCOPE_").unwrap_or(p) == permission);
        if group || permission {
            Ok(())
        } else {
            Err(AuthRejection::AccessDenied(
                "The authenticated identity does not have permission for this operation".into(),
            ))
        }
    }
}

impl Authorizer for ProxyAuthorizer {
    fn authorize_process_read(&self, headers: &HeaderMap) -> Result<(), AuthRejection> {
        ProxyAuthorizer::allows(
            headers,
            &[
                "abada-task-user",
                "abada-process-controller",
                "abada-operator",
                "abada-deployer",
                "abada-admin",
            ],
            "process:read",
        )
    }

    /// `GET /v1/process-instances/**` (the history): `operations:read`, or the operator or
    /// admin group.
    fn authorize_operations_read(&self, headers: &HeaderMap) -> Result<(), AuthRejection> {
        ProxyAuthorizer::allows(
            headers,
            &["abada-operator", "abada-admin"],
            "operations:read",
        )
    }

    /// `/v1/tasks/**`: `task:read` to read, `task:write` to claim and complete, or the
    /// task-user or admin group.
    fn authorize_user_tasks(&self, headers: &HeaderMap, write: bool) -> Result<(), AuthRejection> {
        ProxyAuthorizer::allows(
            headers,
            &["abada-task-user", "abada-admin"],
            if write { "task:write" } else { "task:read" },
        )
    }

    /// The engine's `IdentityContextInterceptor` in `proxy` mode: `X-Auth-Request-User`, else
    /// `X-Auth-Request-Email`; groups from `X-Auth-Request-Groups`. `X-User` means nothing here.
    fn identity(&self, headers: &HeaderMap) -> Option<(String, Vec<String>)> {
        let user = header(headers, "x-auth-request-user")
            .or_else(|| header(headers, "x-auth-request-email"))
            .unwrap_or("anonymous");
        let groups = list(headers, "x-auth-request-groups")
            .map(str::to_string)
            .collect();
        Some((user.to_string(), groups))
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), AuthRejection> {
        if header(headers, "x-auth-request-user").is_none()
            && header(headers, "x-auth-request-email").is_none()
        {
            return Err(AuthRejection::Unauthenticated(
                "Trusted proxy identity headers are missing".into(),
            ));
        }
        let group = list(headers, "x-auth-request-groups").any(|g| {
            let g = g
                .trim_start_matches('/')
                .to_ascii_lowercase()
                .replace('_', "-");
            g == "abada-worker" || g == "abada-admin"
        });
        let permission = list(headers, "x-auth-request-permissions").any(|p| p == "worker:execute");
        if group || permission {
            Ok(())
        } else {
            Err(AuthRejection::AccessDenied(
                "The authenticated identity does not have permission for this operation".into(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn the_engines_proxy_rules() {
        let a = ProxyAuthorizer;
        assert!(matches!(
            a.authorize(&headers(&[])),
            Err(AuthRejection::Unauthenticated(_))
        ));
        assert!(matches!(
            a.authorize(&headers(&[("x-auth-request-user", "w")])),
            Err(AuthRejection::AccessDenied(_))
        ));
        for ok in [
            [
                ("x-auth-request-user", "w"),
                ("x-auth-request-groups", "sales, abada-worker"),
            ],
            [
                ("x-auth-request-user", "w"),
                ("x-auth-request-permissions", "worker:execute"),
            ],
            [
                ("x-auth-request-email", "w@example.com"),
                ("x-auth-request-groups", "/ABADA_WORKER"),
            ],
        ] {
            assert!(a.authorize(&headers(&ok)).is_ok(), "{ok:?}");
        }
        assert!(
            a.authorize(&headers(&[
                ("x-auth-request-user", "w"),
                ("x-auth-request-permissions", "WORKER:EXECUTE")
            ]))
            .is_err()
        );
    }

    #[test]
    fn process_reads_need_process_read_not_the_worker_group() {
        let a = ProxyAuthorizer;
        let worker = [
            ("x-auth-request-user", "w"),
            ("x-auth-request-groups", "abada-worker"),
        ];
        assert!(a.authorize(&headers(&worker)).is_ok());
        assert!(matches!(
            a.authorize_process_read(&headers(&worker)),
            Err(AuthRejection::AccessDenied(_))
        ));
        assert!(matches!(
            a.authorize_process_read(&headers(&[])),
            Err(AuthRejection::Unauthenticated(_))
        ));
        for ok in [
            [
                ("x-auth-request-user", "w"),
                ("x-auth-request-permissions", "worker:execute, process:read"),
            ],
            [
                ("x-auth-request-user", "w"),
                ("x-auth-request-groups", "abada-worker,/abada_task_user"),
            ],
        ] {
            assert!(a.authorize_process_read(&headers(&ok)).is_ok(), "{ok:?}");
        }
    }
}
