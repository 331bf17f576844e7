"""The specgate dashboard: ``streamlit run dashboard/app.py`` (or ``specgate dashboard``).

Talks only to the control plane's REST API, with the key the user signs in with
(or ``SPECGATE_DASHBOARD_API_KEY``).
"""

from __future__ import annotations

import streamlit as st

from dashboard import ui
from dashboard.views import audit, overview, policies, recommendations, rollouts, telemetry

PAGES = (
    (overview.render, "Overview", "overview", ":material/dashboard:"),
    (policies.render, "Policies", "policies", ":material/edit_note:"),
    (rollouts.render, "Rollouts", "rollouts", ":material/rocket_launch:"),
    (telemetry.render, "Telemetry", "telemetry", ":material/monitoring:"),
    (recommendations.render, "Recommendations", "recommendations", ":material/lightbulb:"),
    (audit.render, "Audit log", "audit", ":material/history:"),
)


def _sidebar() -> None:
    cfg = ui.settings()
    session = ui.current()
    with st.sidebar:
        st.markdown("### specgate")
        if session is not None:
            # A key's name is whatever its creator typed: shown literally, like the URL.
            st.markdown(f"Signed in as **{ui.literal(session.who.actor)}** ({session.who.scope})  \n"
                        f"{ui.literal(session.api.base_url)}")
            if st.button("Refresh data", key=ui.key("refresh"),
                         help=f"pages show what the control plane answered up to {ui.READ_TTL_S} s ago"):
                ui.invalidate()
                st.rerun()
            if st.button("Sign out", key=ui.key("sign_out")):
                ui.sign_out()
                st.rerun()
            return
        with st.form(ui.key("sign_in")):
            url = st.text_input("Control plane URL", value=ui.signed_in_url(cfg.api_url))
            key = st.text_input("API key", type="password", placeholder="sgk_...")
            pressed = st.form_submit_button("Sign in", type="primary")
        if pressed:
            if not key.strip():
                st.warning("Enter an API key.")
                return
            problem = ui.sign_in(url.strip(), key)
            if problem is not None:
                ui.show_problem(problem)
                return
            st.rerun()


def main() -> None:
    st.set_page_config(page_title="specgate", page_icon=":material/speed:", layout="wide")
    _sidebar()
    navigation = st.navigation([st.Page(fn, title=title, url_path=path, icon=icon, default=i == 0)
                                for i, (fn, title, path, icon) in enumerate(PAGES)])
    navigation.run()


main()
