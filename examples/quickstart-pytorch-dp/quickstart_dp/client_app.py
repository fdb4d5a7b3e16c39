"""quickstart-dp: the ClientApp."""

from dpfl import client_app

from quickstart_dp.task import federation

app = client_app(lambda context: federation(context.run_config))
